// The native extension of offload/kernels: one translation unit (every extra one costs 15-25 s of
// compile on a 2-core machine) built from the headers beside it, one per concern:
//   common.h       build switches, vector types, the parallel split, argument checks
//   rounding.h     stochastic rounding of bf16 moments              (_rounding.py)
//   vec_io.h       vector loads and stores, bf16 packing, prefetches
//   adamw_math.h   the AdamW lane arithmetic, bitwise torch's       (_adamw.py: fused_adamw_)
//   grad_stats.h   norm terms and checksums                         (_grad_stats.py)
//   outputs.h      checksums of what a span consumes, speculation, copy_, swap_storages_ (_outputs.py)
//   step_options.h step tensors, stochastic rounding keys, version counters
//   mp_adamw.h     fused_mp_adamw_steps_                            (_mp_reference.py, _follow.py)
//   adamw_f32.h    adamw_f32_steps_                                 (_adamw.py: fused_adamw_)
// offload/kernels/_build.py hashes this file and every header it includes into the build key.

#include "adamw_f32.h"
#include "common.h"
#include "grad_stats.h"
#include "mp_adamw.h"
#include "outputs.h"

namespace {

// Distinct intra-op threads one parallel_for used: checks that the kernel's parallel regions run
// on torch's OpenMP runtime (so torch.set_num_threads governs them).
int64_t threads_used(int64_t units) {
  std::vector<std::atomic<int>> seen(static_cast<size_t>(std::max(1, at::get_num_threads())));
  at::parallel_for(0, units, 1, [&](int64_t, int64_t) {
    const int tid = at::get_thread_num();
    if (tid >= 0 && static_cast<size_t>(tid) < seen.size()) seen[tid].store(1);
  });
  int64_t used = 0;
  for (const auto& s : seen) used += s.load();
  return used;
}

std::string capability() {
#if defined(CPU_CAPABILITY)
#define OFFLOAD_STR2(x) #x
#define OFFLOAD_STR(x) OFFLOAD_STR2(x)
  return OFFLOAD_STR(CPU_CAPABILITY);
#else
  return "DEFAULT";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Single-pass AdamW steps for CPU offload, grad_stats, copies (see offload/kernels/_fused_mp.py).";
  // The two AdamW steps: the tensors, then one record of everything else (StepOptions).
  m.def("fused_mp_adamw_steps_", &fused_mp_adamw_steps_, pybind11::arg("params_lowp"),
        pybind11::arg("grads_lowp"), pybind11::arg("masters"), pybind11::arg("exp_avgs"),
        pybind11::arg("exp_avg_sqs"), pybind11::arg("state_steps"), pybind11::kw_only(),
        pybind11::arg("steps_to_increment"), pybind11::arg("into") = std::vector<at::Tensor>{},
        pybind11::arg("checksums") = pybind11::none(), pybind11::arg("seen") = std::vector<at::Tensor>{},
        pybind11::arg("options"),
        "One mixed-precision AdamW step; see offload/kernels/_fused_mp.py.");
  m.def("adamw_f32_steps_", &adamw_f32_steps_, pybind11::arg("params"), pybind11::arg("grads"),
        pybind11::arg("exp_avgs"), pybind11::arg("exp_avg_sqs"), pybind11::arg("state_steps"),
        pybind11::kw_only(), pybind11::arg("outs"), pybind11::arg("steps_to_increment"),
        pybind11::arg("into") = std::vector<at::Tensor>{}, pybind11::arg("checksums") = pybind11::none(),
        pybind11::arg("options"),
        "One fp32 AdamW step (each parameter its own master); see offload/kernels/_fused_mp.py.");
  m.def("grad_stats_", &grad_stats_, pybind11::arg("tensors"), pybind11::kw_only(),
        pybind11::arg("norm"),
        "Per-tensor norm terms (float64) and word checksums (int64); see offload/kernels/_grad_stats.py.");
  m.def("copy_", &copy_, pybind11::arg("dsts"), pybind11::arg("srcs"),
        "dsts[i] = srcs[i] (same dtype and size), non-temporal stores for large calls.");
  m.def("swap_storages_", &swap_storages_, pybind11::arg("a"), pybind11::arg("b"),
        "Swaps the memory of a[i]'s and b[i]'s storages (whole-storage CPU tensors of one size).");
  m.def("capability", &capability, "CPU_CAPABILITY this build was compiled for.");
  m.def("threads_used", &threads_used, pybind11::arg("units"),
        "Distinct intra-op threads a parallel_for over `units` work items ran on.");
  m.def("float_vector_width", []() { return static_cast<int64_t>(fVec::size()); });
}
