// Vector loads and stores of the update loops: where a span's state is read and written
// (StatePtrs), non-temporal stores, fp32/bf16 moments, AVX-512 bf16 packing, prefetches.

#pragma once

#include "common.h"

namespace {

// How far ahead, in elements, the vector loops prefetch every stream they read (2 KB ahead on a
// 16-bit stream, 4 KB on an fp32 one). Without it the lines in flight per core are what the
// out-of-order window reaches, a fixed number of elements ahead: the bf16-moment loop, with the
// same work per element on fewer bytes, then had fewer bytes in flight and ran at the fp32
// loop's time per element instead of at its bytes (50M parameters, 2 threads, interleaved,
// kernel alone: bf16 / fp32 moments 0.95 -> 0.88; 512, 1024 and 2048 elements within noise).
constexpr int64_t kPrefetchElements = 1024;

// Stores one float vector: non-temporal (`NT`: past the caches, no read for ownership; `p`
// aligned to the vector) or plain.
template <bool NT>
OFFLOAD_HOT void put(float* p, const fVec& v) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (NT) {
    _mm512_stream_ps(p, __m512(v));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (NT) {
    _mm256_stream_ps(p, __m256(v));
    return;
  }
#endif
  v.store(p);
}

// Where one span's state is read and where its new state goes: the same addresses for an update
// in place; for a speculation's out-of-place update (`into`), the committed generation is read
// and the next one written (the same bytes moved as in place).
// `M`: the moments' type, float or c10::BFloat16 (state_dtype=torch.bfloat16: the update runs in
// fp32 on the upcast moments, which are rounded to nearest-even as they are stored).
template <typename M>
struct StatePtrs {
  const float* master_in;
  const M* exp_avg_in;
  const M* exp_avg_sq_in;
  float* master_out;
  M* exp_avg_out;
  M* exp_avg_sq_out;

  StatePtrs at(int64_t d) const {
    return {master_in + d, exp_avg_in + d, exp_avg_sq_in + d,
            master_out + d, exp_avg_out + d, exp_avg_sq_out + d};
  }
};

// One float vector of moments at `p` (bf16: upcast, exact; one half-width load).
template <typename M>
OFFLOAD_HOT fVec load_moments(const M* p) {
  if constexpr (std::is_same_v<M, float>) {
    return fVec::loadu(p);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    __m512 v;
    at::vec::cvtbf16_fp32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), v);
    return fVec(v);
#elif defined(CPU_CAPABILITY_AVX2)
    __m256 v;
    at::vec::cvtbf16_fp32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)), v);
    return fVec(v);
#else
    fVec v;
    at::vec::load_to_float<M>(p, v);
    return v;
#endif
  }
}

// Stores one float vector of moments at `p` (bf16: rounded to nearest-even, as Tensor.to(), by
// at::vec's one-vector conversion: one half-width store, never streamed: non-temporal stores
// need 64-byte pieces; only a tensor's last vector comes here on AVX-512, see put_moments2).
template <bool NT, typename M>
OFFLOAD_HOT void put_moments(M* p, const fVec& v) {
  if constexpr (std::is_same_v<M, float>) {
    put<NT>(p, v);
  } else {
#if defined(CPU_CAPABILITY_AVX512)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), at::vec::cvtfp32_bf16(__m512(v)));
#elif defined(CPU_CAPABILITY_AVX2)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), at::vec::cvtfp32_bf16(__m256(v)));
#else
    at::vec::convert_from_float<M>(v, v).store(p, fVec::size());
#endif
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// 32 bf16 values in one 512-bit register <-> two float vectors, by 16-bit word permutes: one
// instruction per float vector each way, where at::vec widens (or narrows) and shifts and, for
// two vectors, packs and permutes besides. Unpack is the exact upcast (the bf16 bits become the
// high half of a float, the low half zero). Pack rounds to nearest-even exactly as at::vec's
// cvtfp32_bf16 (add 0x7FFF plus the lowest kept bit; a NaN becomes 0xFFFF) and takes the high
// halves where at::vec shifts them down and packs with unsigned saturation (a rounded non-NaN
// fits 16 bits, so nothing saturates): the same bits, NaNs, infinities and subnormals included.
alignas(64) constexpr uint16_t kBf16Low[32] = {0, 0, 0, 1,  0, 2,  0, 3,  0, 4,  0, 5,  0, 6,  0, 7,
                                               0, 8, 0, 9,  0, 10, 0, 11, 0, 12, 0, 13, 0, 14, 0, 15};
alignas(64) constexpr uint16_t kBf16High[32] = {0, 16, 0, 17, 0, 18, 0, 19, 0, 20, 0, 21, 0, 22, 0, 23,
                                                0, 24, 0, 25, 0, 26, 0, 27, 0, 28, 0, 29, 0, 30, 0, 31};
alignas(64) constexpr uint16_t kBf16OddWords[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                                    23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                                    45, 47, 49, 51, 53, 55, 57, 59, 61, 63};

inline __m512i load_words(const uint16_t (&table)[32]) {
  return _mm512_load_si512(static_cast<const void*>(table));
}

OFFLOAD_HOT void unpack_bf16(__m512i x, fVec& lo, fVec& hi) {
  constexpr __mmask32 kHighWords = 0xAAAAAAAAu;  // the odd words: each float's high half
  lo = fVec(_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWords, load_words(kBf16Low), x)));
  hi = fVec(_mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(kHighWords, load_words(kBf16High), x)));
}

// The float lanes of `v` plus the rounding bias: each lane's high half is its bf16 (NaN: 0xFFFF).
OFFLOAD_HOT __m512i round_bf16_high(const fVec& v) {
  const __m512i x = _mm512_castps_si512(__m512(v));
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i t = _mm512_add_epi32(_mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)), x);
  return _mm512_mask_mov_epi32(t, _mm512_cmp_ps_mask(__m512(v), __m512(v), _CMP_UNORD_Q),
                               _mm512_set1_epi32(-1));
}

OFFLOAD_HOT __m512i pack_bf16(const fVec& lo, const fVec& hi) {
  return _mm512_permutex2var_epi16(round_bf16_high(lo), load_words(kBf16OddWords), round_bf16_high(hi));
}
#endif

#if OFFLOAD_VECTOR_BUILD
// Two float vectors of moments at `p` (bf16 on AVX-512: one 64-byte load).
template <typename M>
OFFLOAD_HOT void load_moments2(const M* p, fVec& lo, fVec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<M, float>) {
    unpack_bf16(_mm512_loadu_si512(p), lo, hi);
    return;
  }
#endif
  lo = load_moments(p);
  hi = load_moments(p + fVec::size());
}

// Stores two float vectors of moments at `p` (bf16 on AVX-512: one 64-byte store, streamed when
// `NT`, which then guarantees `p` is 64-byte aligned).
template <bool NT, typename M>
OFFLOAD_HOT void put_moments2(M* p, const fVec& lo, const fVec& hi) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<M, float>) {
    const __m512i w = pack_bf16(lo, hi);
    if constexpr (NT) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(p), w);
    } else {
      _mm512_storeu_si512(p, w);
    }
    return;
  }
#endif
  put_moments<NT>(p, lo);
  put_moments<NT>(p + fVec::size(), hi);
}

// Prefetches the streams an update at element `d` of `st` reads, kPrefetchElements ahead: the
// gradient, the master, both moments, and the weights when a span compares with them (`seen`).
// (An address past a tensor's end is harmless: a prefetch never faults.)
template <typename grad_t, typename M, typename param_t = c10::BFloat16>
OFFLOAD_HOT void prefetch_ahead(const grad_t* grad, const StatePtrs<M>& st, int64_t d,
                                const param_t* seen = nullptr) {
  // A loop step covers 2 * fVec::size() elements (32 on AVX-512, 16 on AVX2): the whole lines
  // of that many elements, at least one line, of each stream.
  constexpr int64_t kStep = 2 * fVec::size();
  const auto ahead = [d](const auto* base) OFFLOAD_HOT_LAMBDA {
    constexpr int64_t kLine = 64;
    constexpr int64_t kBytes = std::max<int64_t>(kLine, kStep * sizeof(*base));
    const char* p = reinterpret_cast<const char*>(base + d + kPrefetchElements);
    for (int64_t b = 0; b < kBytes; b += kLine) _mm_prefetch(p + b, _MM_HINT_T0);
  };
  ahead(grad);
  ahead(st.master_in);
  ahead(st.exp_avg_in);
  ahead(st.exp_avg_sq_in);
  if (seen != nullptr) ahead(seen);
}
#endif  // OFFLOAD_VECTOR_BUILD

}  // namespace
