// What every kernel of the extension shares: the build switches (vector or DEFAULT build), the
// vector types, the parallel split into units and blocks (for_each_span), and the argument checks
// every entry point runs before its first write.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

// The per-vector helpers of the update loops are forced inline: left to itself, GCC kept
// adamw_vec and the per-pair lambda out of line (two calls per 32 elements, every vector passed
// through the stack), which cost the bf16-moment loop about a tenth of its DRAM bandwidth.
// Builds without vector instructions (CPU_CAPABILITY DEFAULT, OFFLOAD_VECTOR_BUILD 0) keep the
// update loops exactly as they were before these changes: there at::vec's element loops are
// plain C++, and any change of the code around them (inlining, or the same arithmetic in another
// function) let GCC order the operands of commutative operations differently, which changes the
// payload of a NaN result of two NaN operands (measured: differing NaN payloads in every case of
// a hostile-input comparison, nothing else). Vector builds use intrinsics, whose operands GCC
// keeps in place: their bits, NaN payloads included, are those of before (the same comparison).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#define OFFLOAD_VECTOR_BUILD 1
#define OFFLOAD_HOT inline __attribute__((always_inline))
#define OFFLOAD_HOT_LAMBDA __attribute__((always_inline))
#else
#define OFFLOAD_VECTOR_BUILD 0
#define OFFLOAD_HOT inline
#define OFFLOAD_HOT_LAMBDA
#endif

using fVec = at::vec::Vectorized<float>;

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kHasFma = true;
#else
constexpr bool kHasFma = false;
#endif

using iVec = at::vec::Vectorized<int32_t>;

// Parallel work unit, in elements. A multiple of every Vectorized<float>::size() and of every
// Vectorized<BFloat16/Half>::size(), so a unit boundary never moves an element between the
// vectorised body and the scalar tail: only the last numel % fVec::size() elements of a tensor
// take the scalar path, whatever the thread count (the same elements torch's kernel runs scalar).
constexpr int64_t kUnit = 64;
static_assert(kUnit % fVec::size() == 0, "kUnit must be a multiple of the float vector width");
static_assert(kUnit % at::vec::Vectorized<c10::BFloat16>::size() == 0, "kUnit vs bf16 width");
// Calls of at least this many elements (56 MB of traffic, more than a server's L3 share) write
// the low-precision parameter with non-temporal stores.
constexpr int64_t kStreamMinElements = int64_t(1) << 21;
// Smallest range, in units, worth splitting across threads (64 Ki elements, ~1.8 MB of traffic).
constexpr int64_t kGrainUnits = 1024;
// Work block a thread takes at a time (16 Ki elements, ~460 KB of traffic, ~10 us at 40 GB/s).
constexpr int64_t kBlockUnits = 256;

// Runs `span(i, lo, hi)` over elements [lo, hi) of tensor i for every tensor, in one parallel
// region whose threads take blocks of kBlockUnits from a shared counter rather than a fixed
// 1/threads share each. A fixed share makes every call wait for its slowest thread, and on shared
// or noisy CPUs (another process, an interrupt) that wait is paid once per call, i.e. per chunk;
// with blocks the delayed thread just takes fewer of them. Which thread updates an element changes
// nothing in its arithmetic. Each tensor starts on a unit boundary, so a block maps to unit-aligned
// slices of consecutive tensors; `lo` is a multiple of kUnit.
template <typename SpanFn>
void for_each_span(const std::vector<int64_t>& numel, const SpanFn& span) {
  const size_t n = numel.size();
  std::vector<int64_t> unit_start(n + 1, 0);
  for (size_t i = 0; i < n; ++i) unit_start[i + 1] = unit_start[i] + (numel[i] + kUnit - 1) / kUnit;
  const int64_t total_units = unit_start[n];
  if (total_units == 0) return;
  const auto update_units = [&](int64_t begin, int64_t end) {
    size_t i = static_cast<size_t>(
        std::upper_bound(unit_start.begin(), unit_start.end(), begin) - unit_start.begin() - 1);
    for (; i < n && unit_start[i] < end; ++i) {
      const int64_t lo_unit = std::max(begin, unit_start[i]) - unit_start[i];
      const int64_t hi_unit = std::min(end, unit_start[i + 1]) - unit_start[i];
      const int64_t lo = lo_unit * kUnit;
      const int64_t hi = std::min(hi_unit * kUnit, numel[i]);
      if (hi > lo) span(i, lo, hi);
    }
  };
  const int64_t workers = std::min<int64_t>(at::get_num_threads(),
                                            (total_units + kGrainUnits - 1) / kGrainUnits);
  if (workers <= 1 || at::in_parallel_region()) {
    update_units(0, total_units);
    return;
  }
  const int64_t blocks = (total_units + kBlockUnits - 1) / kBlockUnits;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(1, std::memory_order_relaxed); b < blocks;
         b = next.fetch_add(1, std::memory_order_relaxed)) {
      update_units(b * kBlockUnits, std::min(total_units, (b + 1) * kBlockUnits));
    }
  });
}

// ---- validation (all of it runs before the first write) -------------------------------------
//
// Validation happens entirely before the first write; errors are Python ValueError / TypeError
// naming the argument, the index and the offending dtype or size.

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

[[noreturn]] void fail_value(const std::string& msg) { throw pybind11::value_error(msg); }
[[noreturn]] void fail_type(const std::string& msg) { throw pybind11::type_error(msg); }

// Where a check failed, `fn: arg[i]` (`fn`: the entry point's name, which every message starts
// with). Built only on failure: the checks run several times per tensor per call.
std::string where_of(const char* fn, const char* arg, size_t i) {
  std::ostringstream out;
  out << fn << ": " << arg << "[" << i << "]";
  return out.str();
}

// Fails unless `t` is a defined CPU tensor.
void check_cpu(const char* fn, const at::Tensor& t, const char* arg, size_t i) {
  if (!t.defined()) fail_value(where_of(fn, arg, i) + " is an undefined tensor");
  if (t.device().type() != c10::DeviceType::CPU) {
    fail_value(where_of(fn, arg, i) + " is on device " + t.device().str() + ": expected a CPU tensor");
  }
}

void check_tensor(const char* fn, const at::Tensor& t, const char* arg, size_t i, int64_t numel,
                  at::ScalarType dtype) {
  check_cpu(fn, t, arg, i);
  const auto where = [&]() { return where_of(fn, arg, i); };
  if (t.layout() != c10::kStrided) fail_value(where() + ": expected a dense (strided) tensor");
  if (t.scalar_type() != dtype) {
    fail_type(where() + " has dtype " + dtype_name(t.scalar_type()) + ": expected " +
              dtype_name(dtype));
  }
  if (t.numel() != numel) {
    std::ostringstream msg;
    msg << where() << " has " << t.numel() << " elements (shape " << t.sizes()
        << "): expected " << numel << " like masters[" << i << "]";
    fail_value(msg.str());
  }
  if (!t.is_contiguous()) {
    std::ostringstream msg;
    msg << where() << " is not contiguous (shape " << t.sizes() << ", strides "
        << t.strides() << "): expected a contiguous tensor";
    fail_value(msg.str());
  }
  if (t.is_conj() || t.is_neg()) fail_value(where() + " has a lazy conj/neg bit set");
}

struct Span {
  uintptr_t begin;
  uintptr_t end;
  const char* name;
};

void check_no_overlap(const char* fn, const std::array<Span, 5>& spans, size_t i) {
  for (size_t a = 0; a < spans.size(); ++a) {
    for (size_t b = a + 1; b < spans.size(); ++b) {
      const Span& x = spans[a];
      const Span& y = spans[b];
      if (x.begin < x.end && y.begin < y.end && x.begin < y.end && y.begin < x.end) {
        std::ostringstream msg;
        msg << fn << ": " << x.name << "[" << i << "] and " << y.name << "[" << i
            << "] share memory: expected five distinct buffers per parameter";
        fail_value(msg.str());
      }
    }
  }
}

Span span_of(const at::Tensor& t, const char* name) {
  const auto begin = reinterpret_cast<uintptr_t>(t.const_data_ptr());
  return Span{begin, begin + static_cast<uintptr_t>(t.numel()) * t.element_size(), name};
}

}  // namespace
