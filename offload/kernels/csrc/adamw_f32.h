// The fp32 AdamW step (the parameter is its own master): adamw_f32_steps_. Its reference is torch's
// fused CPU AdamW (offload/kernels/_adamw.py: fused_adamw_).

#pragma once

#include "adamw_math.h"
#include "common.h"
#include "outputs.h"
#include "step_options.h"
#include "vec_io.h"

namespace {

// fp32 parameters: the parameter is its own master. Reads the fp32 gradient where it is, updates
// the parameter and both moments (in place, or out of place: `st`) and, when `out` is not null,
// also stores the new value there (CUDA: the pinned buffer the host-to-device copy reads). The
// lane arithmetic is that of adamw_vec / adamw_scalar, which reproduce torch's fused fp32 kernel;
// the split into vector body and scalar tail is torch's (one float vector at a time, the last
// size % fVec::size() scalar). Traffic: 4 (grad) + 8 + 8 + 8 = 28 bytes per parameter, the same
// as torch's fused kernel, in place or out of place.
template <bool NT = false, bool Sum = false, typename M = float>
void adamw_span_f32(const float* grad, const StatePtrs<M>& st, float* out, int64_t size,
                    const Coeffs& c, const GradXform& x, WordSums<float>* sums = nullptr) {
  constexpr int64_t kW = fVec::size();
  const VecCoeffs k(c);
  int64_t d = 0;
#if OFFLOAD_VECTOR_BUILD
  for (; d + 2 * kW <= size; d += 2 * kW) {  // two vectors at a time (bf16 moments: 64-byte accesses)
    prefetch_ahead(grad, st, d);
    fVec g0 = fVec::loadu(grad + d), g1 = fVec::loadu(grad + d + kW);
    if constexpr (Sum) {  // the words of the very loads the update uses
      sums->add_vec(g0, d);
      sums->add_vec(g1, d + kW);
    }
    if (x.any()) {
      xform_one<float>(g0, x);
      xform_one<float>(g1, x);
    }
    const StatePtrs<M> s0 = st.at(d), s1 = st.at(d + kW);
    fVec p0 = fVec::loadu(s0.master_in), p1 = fVec::loadu(s1.master_in);
    if (c.sr) {
      const iVec r[2] = {sr_hash_vec(c.sr_key, c.sr_index + d), sr_hash_vec(c.sr_key, c.sr_index + d + kW)};
      adamw_vec2<NT>(p0, p1, g0, g1, s0, k, r);
    } else {
      adamw_vec2<NT>(p0, p1, g0, g1, s0, k, nullptr);
    }
    put<NT>(s0.master_out, p0);
    put<NT>(s1.master_out, p1);
    if (out != nullptr) {
      p0.store(out + d);
      p1.store(out + d + kW);
    }
  }
#endif
  for (; d + kW <= size; d += kW) {  // vector builds: at most one more vector (the same lanes)
    fVec g = fVec::loadu(grad + d);
    if constexpr (Sum) sums->add_vec(g, d);  // the words of the very load the update uses
    if (x.any()) xform_one<float>(g, x);
    const StatePtrs<M> s = st.at(d);
    const iVec r = c.sr ? sr_hash_vec(c.sr_key, c.sr_index + d) : iVec(0);
    const fVec p = adamw_vec<NT>(fVec::loadu(s.master_in), g, s, k, c.sr ? &r : nullptr);
    put<NT>(s.master_out, p);
    if (out != nullptr) p.store(out + d);
  }
  const int64_t block_end = d + (kHasFma ? (size - d) / kTailBlock * kTailBlock : 0);
  for (; d < size; ++d) {
    const float gv = grad[d];
    if constexpr (Sum) sums->add_words(&gv, d, 1);
    const float g = x.any() ? xform_scalar<float>(gv, x) : gv;
    const StatePtrs<M> s = st.at(d);
    const float p = adamw_scalar(*s.master_in, g, s, d < block_end, c, d);
    *s.master_out = p;
    if (out != nullptr) out[d] = p;
  }
}

// adamw_f32_steps_'s update (moments of type M), with the GIL released.
template <typename M>
void run_f32(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
             const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
             const std::vector<at::Tensor>& outs, const std::vector<Coeffs>& coeffs, const GradXform& x,
             const Speculate& spec) {
  const size_t n = params.size();
  std::vector<float*> pp(n), op(n);
  std::vector<M*> ea(n), eas(n);
  std::vector<const float*> gp(n);
  std::vector<int64_t> numel(n);
  for (size_t i = 0; i < n; ++i) {
    pp[i] = params[i].mutable_data_ptr<float>();
    gp[i] = grads[i].const_data_ptr<float>();
    ea[i] = exp_avgs[i].mutable_data_ptr<M>();
    eas[i] = exp_avg_sqs[i].mutable_data_ptr<M>();
    op[i] = outs.empty() ? nullptr : outs[i].mutable_data_ptr<float>();
    numel[i] = params[i].numel();
  }
  for_each_span(numel, [&](size_t i, int64_t lo, int64_t hi) {
    const StatePtrs<M> st = state_ptrs<M>(&spec, i, pp[i], ea[i], eas[i]);
    const bool nt = streamable(st.at(lo));
    speculated<float>(&spec, i, lo, hi, [&](int64_t a, int64_t b, WordSums<float>* sums) {
      const float* g = gp[i] + a;
      float* out = op[i] == nullptr ? nullptr : op[i] + a;
      Coeffs ca = coeffs[i];
      ca.sr_index += a;  // (stochastic rounding: element indices count from the span)
      if (sums != nullptr && nt) {
        adamw_span_f32<true, true, M>(g, st.at(a), out, b - a, ca, x, sums);
      } else if (sums != nullptr) {
        adamw_span_f32<false, true, M>(g, st.at(a), out, b - a, ca, x, sums);
      } else if (nt) {
        adamw_span_f32<true, false, M>(g, st.at(a), out, b - a, ca, x);
      } else {
        adamw_span_f32<false, false, M>(g, st.at(a), out, b - a, ca, x);
      }
    });
    if (nt) fence_streams();
  });
}

// fp32 parameters (each its own master) with fp32 gradients, torch's step bookkeeping as in
// fused_mp_adamw_steps_. `outs`: empty, or one fp32 tensor per parameter that receives a copy of
// the updated parameter. Every check runs before the first write.
// The tensors, then `options` (StepOptions), as fused_mp_adamw_steps_.
void adamw_f32_steps_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& exp_avgs,
                      const std::vector<at::Tensor>& exp_avg_sqs,
                      const std::vector<at::Tensor>& state_steps,
                      const std::vector<at::Tensor>& outs,
                      const std::vector<at::Tensor>& steps_to_increment,
                      const std::vector<at::Tensor>& into,
                      const std::optional<at::Tensor>& checksums, pybind11::handle options) {
  const char* fn = "adamw_f32_steps_";
  const StepOptions o = read_options(fn, options);
  const size_t n = params.size();
  const bool with_out = !outs.empty();
  const std::vector<std::pair<const char*, const std::vector<at::Tensor>*>> lists = {
      {"grads", &grads}, {"exp_avgs", &exp_avgs}, {"exp_avg_sqs", &exp_avg_sqs}, {"outs", &outs}};
  for (const auto& [name, list] : lists) {
    if (list->size() != n && !(list == &outs && outs.empty())) {
      std::ostringstream msg;
      msg << fn << ": " << name << " has " << list->size() << " tensors: expected " << n
          << " like params" << (list == &outs ? " (or none)" : "");
      fail_value(msg.str());
    }
  }
  const at::ScalarType m_dtype = moments_dtype(fn, exp_avgs);
  for (size_t i = 0; i < n; ++i) {
    if (!params[i].defined()) {
      fail_value(std::string(fn) + ": params[" + std::to_string(i) + "] is an undefined tensor");
    }
    const int64_t numel = params[i].numel();
    check_tensor(fn, params[i], "params", i, numel, at::kFloat);
    check_tensor(fn, grads[i], "grads", i, numel, at::kFloat);
    check_tensor(fn, exp_avgs[i], "exp_avgs", i, numel, m_dtype);
    check_tensor(fn, exp_avg_sqs[i], "exp_avg_sqs", i, numel, m_dtype);
    if (with_out) check_tensor(fn, outs[i], "outs", i, numel, at::kFloat);
    check_no_overlap(fn, {span_of(params[i], "params"), span_of(grads[i], "grads"),
                          span_of(exp_avgs[i], "exp_avgs"), span_of(exp_avg_sqs[i], "exp_avg_sqs"),
                          with_out ? span_of(outs[i], "outs") : Span{0, 0, "outs"}},
                     i);
  }
  Speculate spec = make_speculate(fn, grads, params, exp_avgs, exp_avg_sqs, into, checksums);
  std::unordered_map<float*, float> incremented;
  std::vector<Coeffs> coeffs = step_coeffs(fn, "params", n, state_steps, steps_to_increment, o,
                                           incremented);
  stochastic_rounding(fn, coeffs, o, m_dtype);
  for (const auto* list : {&params, &exp_avgs, &exp_avg_sqs, &outs, &steps_to_increment}) {
    const bool read_only = !into.empty() && list != &outs && list != &steps_to_increment;
    if (read_only) continue;  // out of place: the state is only read (an own master keeps its version)
    for (const at::Tensor& t : *list) t.unsafeGetTensorImpl()->bump_version();
  }
  for (const auto& [p, v] : incremented) *p = v;  // the first write
  if (n == 0) {
    finish_speculate(spec, into, checksums, n);
    return;
  }
  const GradXform x = make_xform(o.grad_scale, o.grad_coef);
  {
    pybind11::gil_scoped_release no_gil;
    if (m_dtype == at::kBFloat16) {
      run_f32<c10::BFloat16>(params, grads, exp_avgs, exp_avg_sqs, outs, coeffs, x, spec);
    } else {
      run_f32<float>(params, grads, exp_avgs, exp_avg_sqs, outs, coeffs, x, spec);
    }
  }
  finish_speculate(spec, into, checksums, n);
}

}  // namespace
