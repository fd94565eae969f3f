// What the kernels write besides the update (offload/kernels/_outputs.py): the checksum words of
// what a span consumes and a speculation's out-of-place generation (speculation_outputs is their
// torch-ops reference), the weight copies of committed speculations (copy_) and the commit
// (swap_storages_).

#pragma once

#include "common.h"
#include "grad_stats.h"
#include "vec_io.h"

namespace {

// The checksum words of the gradient a span consumes, taken from the registers the update reads
// (so what is checksummed is exactly what is consumed, even while another thread writes the
// gradient: no second read of memory). Lane j of 32 holds the wrapping sum of the words of the
// elements e with e % 32 == j (a span starts on a multiple of kUnit, so `d % 32` is that lane):
// fp32 words sign-extended into 64-bit lanes, 16-bit words zero-extended into 32-bit lanes (a
// call covers at most kStatsBlock elements: 512 words of at most 0xFFFF per lane). `weighted()`
// is then grad_stats' checksum of the span (grad_stats.h), whatever vector width added the words.
template <typename grad_t>
struct WordSums {
  using lane_t = std::conditional_t<std::is_same_v<grad_t, float>, uint64_t, uint32_t>;
  alignas(64) lane_t lane[32] = {};

  // `n` elements starting at `d` (a multiple of the vector's width), raw words in `p`.
  inline void add_words(const grad_t* p, int64_t d, int64_t n) {
    for (int64_t j = 0; j < n; ++j) lane[(d + j) & 31] += static_cast<lane_t>(word_of(p + j));
  }

  // A float vector's words at element d (fp32 gradients).
  OFFLOAD_HOT void add_vec(const fVec& v, int64_t d) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i w = _mm512_castps_si512(__m512(v));
    uint64_t* l = reinterpret_cast<uint64_t*>(lane) + (d & 31);
    const __m512i lo = _mm512_cvtepi32_epi64(_mm512_castsi512_si256(w));
    const __m512i hi = _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(w, 1));
    _mm512_store_si512(l, _mm512_add_epi64(_mm512_load_si512(l), lo));
    _mm512_store_si512(l + 8, _mm512_add_epi64(_mm512_load_si512(l + 8), hi));
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i w = _mm256_castps_si256(__m256(v));
    uint64_t* l = reinterpret_cast<uint64_t*>(lane) + (d & 31);
    const __m256i lo = _mm256_cvtepi32_epi64(_mm256_castsi256_si128(w));
    const __m256i hi = _mm256_cvtepi32_epi64(_mm256_extracti128_si256(w, 1));
    auto* a = reinterpret_cast<__m256i*>(l);
    _mm256_store_si256(a, _mm256_add_epi64(_mm256_load_si256(a), lo));
    _mm256_store_si256(a + 1, _mm256_add_epi64(_mm256_load_si256(a + 1), hi));
#else
    alignas(64) float tmp[fVec::size()];
    v.store(tmp);
    add_words(reinterpret_cast<const grad_t*>(tmp), d, fVec::size());
#endif
  }

  // A low-precision vector's words at element d (16-bit gradients; lanes past a partial load are
  // zero words and add nothing).
  template <typename V>
  OFFLOAD_HOT void add_lowp(const V& v, int64_t d) {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i w = __m512i(v);
    uint32_t* l = reinterpret_cast<uint32_t*>(lane) + (d & 31);
    const __m512i lo = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(w));
    const __m512i hi = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1));
    if ((d & 31) == 0) {
      _mm512_store_si512(l, _mm512_add_epi32(_mm512_load_si512(l), lo));
      _mm512_store_si512(l + 16, _mm512_add_epi32(_mm512_load_si512(l + 16), hi));
    } else {  // a partial vector at lane 16: its upper half is zeros
      _mm512_store_si512(l, _mm512_add_epi32(_mm512_load_si512(l), lo));
    }
#elif defined(CPU_CAPABILITY_AVX2)
    const __m256i w = __m256i(v);
    auto* a = reinterpret_cast<__m256i*>(reinterpret_cast<uint32_t*>(lane) + (d & 31));
    const __m256i lo = _mm256_cvtepu16_epi32(_mm256_castsi256_si128(w));
    const __m256i hi = _mm256_cvtepu16_epi32(_mm256_extracti128_si256(w, 1));
    _mm256_store_si256(a, _mm256_add_epi32(_mm256_load_si256(a), lo));
    _mm256_store_si256(a + 1, _mm256_add_epi32(_mm256_load_si256(a + 1), hi));  // lanes up to 31
#else
    alignas(64) grad_t tmp[V::size()];
    v.store(tmp);
    add_words(tmp, d, std::min<int64_t>(V::size(), 32 - (d & 31)));
#endif
  }

  uint64_t weighted() const {
    uint64_t out = 0;
    for (int j = 0; j < 32; ++j) out += static_cast<uint64_t>(lane[j]) * lane_weight(j);
    return out;
  }
};

// ---- speculation (offload/overlap/_speculation.py) ------------------------------------------
//
// A chunk updated during backward is a guess that step() commits or redoes. Called with `into`
// and `checksums`, the kernels make the guess in their own pass, out of place: the committed
// master and moments are only read, and the new ones are written into the next generation
// (`into`, three fp32 tensors per tensor), streamed past the caches where aligned. That moves
// the same bytes as an update in place (read 12, write 12 per element): commit swaps which
// generation is live (no copy), a redo reruns the kernel from the committed one (no restore).
// With checksums, before each piece of at most kStatsBlock elements is updated, the words of its
// gradient are added into the tensor's checksum (grad_stats' checksum: a piece starts on a
// multiple of kUnit, a lane boundary, so the pieces' sums add up, modulo 2^64, to the checksum of
// the whole tensor).
struct Speculate {
  std::vector<void*> into;  // 3 per tensor (master fp32, exp_avg and exp_avg_sq: the moments' type), or empty
  std::unique_ptr<std::atomic<uint64_t>[]> sums;  // per tensor, or null

  bool any() const { return !into.empty() || sums != nullptr; }
};

static_assert(kStatsBlock % kUnit == 0, "a speculation piece must end on a unit boundary");

// Where tensor i's state is read and written (StatePtrs): in place, or out of place into the
// speculation's next generation.
template <typename M>
inline StatePtrs<M> state_ptrs(const Speculate* s, size_t i, float* master, M* exp_avg, M* exp_avg_sq) {
  if (s == nullptr || s->into.empty()) {
    return {master, exp_avg, exp_avg_sq, master, exp_avg, exp_avg_sq};
  }
  return {master, exp_avg, exp_avg_sq, static_cast<float*>(s->into[3 * i]),
          static_cast<M*>(s->into[3 * i + 1]), static_cast<M*>(s->into[3 * i + 2])};
}

// The new state of a span may be streamed: it goes to another buffer than the one read (out of
// place), and every vector store is aligned (the span starts on a 64-byte boundary of all three).
template <typename M>
inline bool streamable(const StatePtrs<M>& s) {
  constexpr uintptr_t kAlign = 64;
  return s.master_out != s.master_in && reinterpret_cast<uintptr_t>(s.master_out) % kAlign == 0 &&
         reinterpret_cast<uintptr_t>(s.exp_avg_out) % kAlign == 0 &&
         reinterpret_cast<uintptr_t>(s.exp_avg_sq_out) % kAlign == 0;
}

inline void fence_streams() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();  // streamed stores are visible before anything reads them
#endif
}

// Runs `update(lo, hi, sums)` over [lo, hi) of tensor i: with checksums, piece by piece (at most
// kStatsBlock elements, the 32-bit lanes of WordSums cannot overflow), each piece's words summed
// by the update from the very loads it consumes (`sums`), then added into the tensor's checksum;
// without, in one call (`sums` null). Pieces split at multiples of kUnit from `lo`: the vector
// body / scalar tail split of every element stays as it is (the same rule that makes the thread
// count irrelevant), and every piece starts on a lane boundary.
template <typename grad_t, typename UpdateFn>
inline void speculated(const Speculate* s, size_t i, int64_t lo, int64_t hi,
                       const UpdateFn& update) {
  if (s == nullptr || s->sums == nullptr) {
    update(lo, hi, static_cast<WordSums<grad_t>*>(nullptr));
    return;
  }
  for (int64_t a = lo; a < hi; a += kStatsBlock) {
    const int64_t b = std::min(hi, a + kStatsBlock);
    WordSums<grad_t> sums;
    update(a, b, &sums);
    s->sums[i].fetch_add(sums.weighted(), std::memory_order_relaxed);
  }
}

// The speculation arguments of one call (see Speculate), checked before anything is written:
// `into` empty or three fp32 tensors per tensor (its new master, exp_avg and exp_avg_sq, at
// 3i, 3i+1, 3i+2: contiguous CPU tensors of its size, apart from its operands); `checksums` none
// or a contiguous int64 CPU tensor of one element per tensor (written after the update).
Speculate make_speculate(const char* fn, const std::vector<at::Tensor>& grads,
                         const std::vector<at::Tensor>& masters,
                         const std::vector<at::Tensor>& exp_avgs,
                         const std::vector<at::Tensor>& exp_avg_sqs,
                         const std::vector<at::Tensor>& into,
                         const std::optional<at::Tensor>& checksums) {
  const size_t n = masters.size();
  Speculate spec;
  if (!into.empty()) {
    if (into.size() != 3 * n) {
      std::ostringstream msg;
      msg << fn << ": into has " << into.size() << " tensors: expected 0 or " << 3 * n
          << " (master, exp_avg and exp_avg_sq new state of each of the " << n << " tensors)";
      fail_value(msg.str());
    }
    spec.into.resize(3 * n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t numel = masters[i].numel();
      for (size_t k = 0; k < 3; ++k) {
        const at::Tensor& t = into[3 * i + k];
        check_tensor(fn, t, "into", 3 * i + k, numel, k == 0 ? at::kFloat : exp_avgs[i].scalar_type());
        check_no_overlap(fn, {span_of(t, "into"), span_of(grads[i], "grads"),
                              span_of(masters[i], "masters"), span_of(exp_avgs[i], "exp_avgs"),
                              span_of(exp_avg_sqs[i], "exp_avg_sqs")},
                         i);
        spec.into[3 * i + k] = t.mutable_data_ptr();
      }
    }
  }
  if (checksums.has_value()) {
    const at::Tensor& c = *checksums;
    if (!c.defined() || c.device().type() != c10::DeviceType::CPU ||
        c.scalar_type() != at::kLong || !c.is_contiguous() || c.numel() != static_cast<int64_t>(n)) {
      std::ostringstream msg;
      msg << fn << ": checksums must be a contiguous torch.int64 CPU tensor of " << n
          << " elements (one per tensor)";
      fail_value(msg.str());
    }
    spec.sums.reset(new std::atomic<uint64_t>[n]);
    for (size_t i = 0; i < n; ++i) spec.sums[i].store(0, std::memory_order_relaxed);
  }
  return spec;
}

// After the update: the checksums into their tensor, the next generation's version counters bumped.
void finish_speculate(Speculate& spec, const std::vector<at::Tensor>& into,
                      const std::optional<at::Tensor>& checksums, size_t n) {
  if (spec.sums != nullptr) {
    int64_t* out = checksums->mutable_data_ptr<int64_t>();
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<int64_t>(spec.sums[i].load());
    checksums->unsafeGetTensorImpl()->bump_version();
  }
  for (const at::Tensor& t : into) t.unsafeGetTensorImpl()->bump_version();
}

// ---- copy_: the weight copies of committed speculations -----------------------------------
//
// dsts[i] = srcs[i], same dtype (4 or 2 bytes) and size, both contiguous CPU tensors, in one
// parallel region (blocks from a shared counter, as the update). The destination is only written:
// in a call too large for the caches, with non-temporal stores where it is aligned, so no read for
// ownership adds its bytes (a fifth to a third of a plain copy's traffic).
template <typename T>
inline void copy_span(const T* src, T* dst, int64_t n, bool stream) {
  int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if (stream && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    constexpr int64_t kW = 64 / sizeof(T);
    for (; d + kW <= n; d += kW) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + d),
                          _mm512_loadu_si512(reinterpret_cast<const void*>(src + d)));
    }
    _mm_sfence();
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (stream && reinterpret_cast<uintptr_t>(dst) % 32 == 0) {
    constexpr int64_t kW = 32 / sizeof(T);
    for (; d + kW <= n; d += kW) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + d),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + d)));
    }
    _mm_sfence();
  }
#endif
  if (d < n) std::memcpy(dst + d, src + d, static_cast<size_t>(n - d) * sizeof(T));
}

void copy_(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs) {
  const char* fn = "copy_";
  const size_t n = dsts.size();
  if (srcs.size() != n) {
    std::ostringstream msg;
    msg << fn << ": srcs has " << srcs.size() << " tensors: expected " << n << " like dsts";
    fail_value(msg.str());
  }
  std::vector<int64_t> numel(n);
  std::vector<const char*> sp(n);
  std::vector<char*> dp(n);
  int64_t total = 0;
  size_t width = 0;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& d = dsts[i];
    const at::ScalarType dt = d.defined() ? d.scalar_type() : at::kFloat;
    if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) {
      fail_type(std::string(fn) + ": dsts[" + std::to_string(i) + "] has dtype " + dtype_name(dt) +
                ": expected torch.float32, torch.bfloat16 or torch.float16");
    }
    check_tensor(fn, d, "dsts", i, d.numel(), dt);
    check_tensor(fn, srcs[i], "srcs", i, d.numel(), dt);
    const size_t w = static_cast<size_t>(d.element_size());
    if (width == 0) width = w;
    if (w != width) fail_type(std::string(fn) + ": dsts mixes element sizes: expected one dtype width per call");
    const Span a = span_of(d, "dsts"), b = span_of(srcs[i], "srcs");
    if (a.begin < a.end && a.begin < b.end && b.begin < a.end) {
      fail_value(std::string(fn) + ": dsts[" + std::to_string(i) + "] and srcs[" +
                 std::to_string(i) + "] share memory");
    }
    numel[i] = d.numel();
    sp[i] = static_cast<const char*>(srcs[i].const_data_ptr());
    dp[i] = static_cast<char*>(d.mutable_data_ptr());
    total += numel[i];
  }
  for (const at::Tensor& d : dsts) d.unsafeGetTensorImpl()->bump_version();
  if (total == 0) return;
  const bool stream = total * static_cast<int64_t>(width) >= kStreamMinElements * 4;
  pybind11::gil_scoped_release no_gil;
  for_each_span(numel, [&](size_t i, int64_t lo, int64_t hi) {
    if (width == 4) {
      copy_span(reinterpret_cast<const float*>(sp[i]) + lo, reinterpret_cast<float*>(dp[i]) + lo,
                hi - lo, stream);
    } else {
      copy_span(reinterpret_cast<const uint16_t*>(sp[i]) + lo,
                reinterpret_cast<uint16_t*>(dp[i]) + lo, hi - lo, stream);
    }
  });
}

// Swaps the memory of a[i] and b[i]'s storages (each tensor the whole of its own CPU storage, the
// pair of one size): every tensor viewing either storage sees the other's bytes from now on, with
// no byte copied. A speculation's commit (offload/state/_slabs.py, HostSlabs.swap): the next
// generation becomes the committed one under the views optimizer.state holds. Checks all pairs
// before swapping any.
void swap_storages_(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  const char* fn = "swap_storages_";
  if (a.size() != b.size()) {
    std::ostringstream msg;
    msg << fn << ": " << a.size() << " and " << b.size() << " tensors: expected pairs";
    fail_value(msg.str());
  }
  for (size_t i = 0; i < a.size(); ++i) {
    for (const auto& [t, name] : {std::pair{&a[i], "a"}, std::pair{&b[i], "b"}}) {
      const auto where = [&]() { return std::string(fn) + ": " + name + "[" + std::to_string(i) + "]"; };
      if (!t->defined() || t->device().type() != c10::DeviceType::CPU) {
        fail_value(where() + ": expected a defined CPU tensor");
      }
      if (t->storage_offset() != 0 || !t->is_contiguous() ||
          static_cast<size_t>(t->numel() * t->element_size()) != t->storage().nbytes()) {
        fail_value(where() + ": expected a contiguous tensor over the whole of its storage");
      }
    }
    if (a[i].storage().nbytes() != b[i].storage().nbytes()) {
      fail_value(std::string(fn) + ": a[" + std::to_string(i) + "] and b[" + std::to_string(i) +
                 "] have storages of different sizes");
    }
    if (a[i].storage().unsafeGetStorageImpl() == b[i].storage().unsafeGetStorageImpl()) {
      fail_value(std::string(fn) + ": a[" + std::to_string(i) + "] and b[" + std::to_string(i) +
                 "] share one storage");
    }
  }
  for (size_t i = 0; i < a.size(); ++i) {
    a[i].storage().unsafeGetStorageImpl()->swap_data_ptr(*b[i].storage().unsafeGetStorageImpl());
    a[i].unsafeGetTensorImpl()->bump_version();
    b[i].unsafeGetTensorImpl()->bump_version();
  }
}

}  // namespace
