// Single-pass AdamW steps for CPU offload: mixed precision (bf16/fp16 parameter, fp32 master)
// and fp32 (the parameter is its own master, adamw_f32_steps_).
//
// One pass per element: read the low-precision (bf16/fp16) gradient, upcast it exactly to fp32,
// update the fp32 master weight and both fp32 moments in place, and write the master, rounded to
// nearest-even, into the low-precision parameter. Traffic: 2 (grad) + 8 (master r/w) + 8 (exp_avg
// r/w) + 8 (exp_avg_sq r/w) + 2 (param write) = 28 bytes per parameter (large calls write the
// parameter with non-temporal stores, so no read-for-ownership adds 2 more).
//
// Bitwise agreement with torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
// float tensors, ADAMW mode, no amsgrad/maximize/grad scaling):
// - the scalar coefficients are computed in double and cast to float exactly as torch does;
// - every tensor is split into the same vectorised body (numel rounded down to a multiple of
//   Vectorized<float>::size()) and scalar tail as torch splits it;
// - this file is compiled with -ffp-contract=off, and every fused multiply-add is written out.
//   torch's kernel is compiled by GCC with contraction on, so its binary fuses where GCC chose to.
//   The choices below were read off torch 2.13's x86 wheels by comparing results element by element
//   (offload/kernels/_fused_mp.py lists the verified builds; tests/test_fused_mp.py checks them):
//     exp_avg     lerp as one FMA everywhere (the vector code calls vec::fmadd; the scalar code
//                 was contracted the same way);
//     exp_avg_sq  vector body: fma(c2*g, g, v*beta2). Scalar tail: GCC auto-vectorised torch's
//                 tail loop 8 lanes wide, so the first multiple of 8 tail elements use that same
//                 form and the remaining ones fma(v, beta2, (c2*g)*g);
//     param       no FMA (p * (1 - lr*wd), then + (-step_size * m) / denom).
//   Builds without FMA instructions (CPU_CAPABILITY DEFAULT) fuse nothing, as torch's DEFAULT
//   kernel does not.
//
// Gradient transforms (offload.kernels._adamw.Hyper.grad_scale / grad_coef), applied to the fp32 value
// of each gradient element as it is loaded, so they cost no pass of their own; the gradient in
// memory is never written. First `g / grad_scale` (torch's fused AdamW with a GradScaler: an fp32
// IEEE division, vector and scalar alike), then `* grad_coef` rounded to the gradient's dtype
// (what torch._foreach_mul_(grads, coef) stores into a bf16/fp16 gradient: the fp32 product
// rounded to nearest-even by the same at::vec conversions; only NaN payloads may differ, as they
// differ between torch's own vector and scalar paths).
//
// Validation happens entirely before the first write; errors are Python ValueError / TypeError
// naming the argument, the index and the offending dtype or size.

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
// Scalar-tail elements that torch's (auto-vectorised) tail loop handles 8 at a time; see above.
constexpr int64_t kTailBlock = 8;

// a * b + c with one rounding where torch's binary fuses, two where it does not.
inline float madd(float a, float b, float c) {
  if constexpr (kHasFma) {
    return std::fma(a, b, c);
  } else {
    return a * b + c;
  }
}

// What is done to each gradient element before the update (see the header comment).
struct GradXform {
  bool scale = false;  // divide by s
  bool coef = false;   // then multiply by c, rounded to the gradient's dtype
  float s = 1.0f;
  float c = 1.0f;
  bool any() const { return scale || coef; }
};

GradXform make_xform(const std::optional<double>& grad_scale,
                     const std::optional<double>& grad_coef) {
  GradXform x;
  if (grad_scale.has_value()) {
    x.scale = true;
    x.s = static_cast<float>(*grad_scale);  // the fp32 value of a 0-d fp32 tensor: exact
  }
  if (grad_coef.has_value()) {
    x.coef = true;
    x.c = static_cast<float>(*grad_coef);
  }
  return x;
}

// Two float vectors holding one low-precision (or two fp32) gradient vector(s) of type grad_t.
template <typename grad_t>
OFFLOAD_HOT void xform_pair(fVec& g0, fVec& g1, const GradXform& x) {
  if (x.scale) {
    g0 = g0 / fVec(x.s);
    g1 = g1 / fVec(x.s);
  }
  if (x.coef) {
    g0 = g0 * fVec(x.c);
    g1 = g1 * fVec(x.c);
    if constexpr (!std::is_same_v<grad_t, float>) {
      std::tie(g0, g1) =
          at::vec::convert_to_float<grad_t>(at::vec::convert_from_float<grad_t>(g0, g1));
    }
  }
}

template <typename grad_t>
OFFLOAD_HOT void xform_one(fVec& g0, const GradXform& x) {
  fVec g1 = g0;
  xform_pair<grad_t>(g0, g1, x);  // lane-wise: the duplicate changes nothing in g0
}

template <typename grad_t>
inline float xform_scalar(float g, const GradXform& x) {
  if (x.scale) g = g / x.s;
  if (x.coef) {
    g = g * x.c;
    if constexpr (!std::is_same_v<grad_t, float>) {
      g = static_cast<float>(static_cast<grad_t>(g));  // round to nearest even, as Tensor.mul_
    }
  }
  return g;
}

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
// How far ahead, in elements, the vector loops prefetch every stream they read (2 KB ahead on a
// 16-bit stream, 4 KB on an fp32 one). Without it the lines in flight per core are what the
// out-of-order window reaches, a fixed number of elements ahead: the bf16-moment loop, with the
// same work per element on fewer bytes, then had fewer bytes in flight and ran at the fp32
// loop's time per element instead of at its bytes (50M parameters, 2 threads, interleaved,
// kernel alone: bf16 / fp32 moments 0.95 -> 0.88; 512, 1024 and 2048 elements within noise).
constexpr int64_t kPrefetchElements = 1024;

// Scalar coefficients, computed exactly as torch's kernel computes them.
struct Coeffs {
  double lr;
  double exp_avg_grad_coefficient;     // 1 - beta1
  double exp_avg_sq_grad_coefficient;  // 1 - beta2
  double beta2;
  double step_size;                    // lr / (1 - beta1^step)
  double bias_correction2_sqrt;        // sqrt(1 - beta2^step)
  double eps;
  double weight_decay;
  float step = 0.0f;  // the step value the coefficients are of
  // Stochastic rounding of bf16 moments (state_rounding="stochastic", see sr_hash): off, or the
  // tensor's key and the index, in its parameter, of the tensor's first element.
  bool sr = false;
  uint32_t sr_key = 0;
  int64_t sr_index = 0;
};

// `step_f`: the step as torch holds it, a float read from the fp32 step tensor (widened to double).
Coeffs make_coeffs(float step_f, double lr, double beta1, double beta2, double eps,
                   double weight_decay) {
  const double step_d = static_cast<double>(step_f);
  Coeffs c{};
  c.lr = lr;
  const double bias_correction1 = 1 - std::pow(beta1, step_d);
  const double bias_correction2 = 1 - std::pow(beta2, step_d);
  c.exp_avg_grad_coefficient = 1 - beta1;
  c.exp_avg_sq_grad_coefficient = 1 - beta2;
  c.beta2 = beta2;
  c.step_size = lr / bias_correction1;
  c.bias_correction2_sqrt = std::sqrt(bias_correction2);
  c.eps = eps;
  c.weight_decay = weight_decay;
  c.step = step_f;
  return c;
}

// ---- stochastic rounding of bf16 moments (offload/kernels/_rounding.py is the same in torch ops)
//
// Element j of a parameter (j < 2^32) gets 32 random bits h = sr_hash(key, j), key =
// sr_key(seed, step, slot): a function of the seed, the step, the parameter and the element only,
// so the bits are the same for any thread count, chunk size or speculation. exp_avg takes the low
// 16 bits, exp_avg_sq the high 16: added to the fp32 value's bits, then the low 16 bits dropped
// (round up with probability equal to the dropped fraction; a NaN stays NaN).
constexpr uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

inline uint32_t sr_key(uint64_t seed, float step, int64_t slot) {
  const uint64_t s = static_cast<uint64_t>(step);  // a whole number of steps
  return static_cast<uint32_t>(splitmix64(seed ^ splitmix64((s << 32) ^ static_cast<uint64_t>(slot))));
}

// murmur3's finaliser on (key ^ j), 32-bit: logical shifts, wrapping products.
inline int32_t sr_hash(uint32_t key, uint32_t j) {
  uint32_t x = key ^ j;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return static_cast<int32_t>(x);
}

using iVec = at::vec::Vectorized<int32_t>;

OFFLOAD_HOT iVec sr_hash_vec(uint32_t key, int64_t j0) {
  // (int32 lanes: a logical shift is the arithmetic one with the sign copies masked off)
  iVec x = iVec(static_cast<int32_t>(key)) ^ iVec::arange(static_cast<int32_t>(static_cast<uint32_t>(j0)), 1);
  x = x ^ ((x >> iVec(16)) & iVec(0xFFFF));
  x = x * iVec(static_cast<int32_t>(0x85EBCA6Bu));
  x = x ^ ((x >> iVec(13)) & iVec(0x7FFFF));
  x = x * iVec(static_cast<int32_t>(0xC2B2AE35u));
  return x ^ ((x >> iVec(16)) & iVec(0xFFFF));
}

// `v` with `r` (0..65535) added to its bits and the low 16 bits dropped: a bf16 value, exact.
OFFLOAD_HOT fVec sr_round(const fVec& v, const iVec& r) {
  const fVec t = at::vec::cast<float>((at::vec::cast<int32_t>(v) + r) & iVec(static_cast<int32_t>(0xFFFF0000u)));
  return fVec::blendv(v, t, v == v);  // (a NaN keeps its value: rounded to nearest as it is stored)
}

inline float sr_round_scalar(float v, int32_t r) {
  if (std::isnan(v)) return v;
  uint32_t b;
  std::memcpy(&b, &v, sizeof(b));
  b = (b + static_cast<uint32_t>(r)) & 0xFFFF0000u;
  float t;
  std::memcpy(&t, &b, sizeof(t));
  return t;
}

// The coefficients as float vectors, built once per span (torch builds the same values inline).
struct VecCoeffs {
  explicit VecCoeffs(const Coeffs& c)
      : decay(float(1 - c.lr * c.weight_decay)),
        lerp_coeff(std::abs(float(c.exp_avg_grad_coefficient)) < 0.5f
                       ? fVec(float(c.exp_avg_grad_coefficient))
                       : fVec(float(c.exp_avg_grad_coefficient)) - fVec(1)),
        c2(float(c.exp_avg_sq_grad_coefficient)),
        beta2(float(c.beta2)),
        bias_correction2_sqrt(float(c.bias_correction2_sqrt)),
        eps(float(c.eps)),
        neg_step_size(float(-c.step_size)),
        lerp_small(std::abs(float(c.exp_avg_grad_coefficient)) < 0.5f),
        do_decay(c.weight_decay != 0.f) {}
  fVec decay, lerp_coeff, c2, beta2, bias_correction2_sqrt, eps, neg_step_size;
  bool lerp_small, do_decay;
};

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

// The AdamW arithmetic on the fp32 lanes of one vector: returns the new master and updates the
// moments in the registers (unrounded: what is stored is rounded by the caller, the update uses
// these).
OFFLOAD_HOT fVec adamw_lanes(fVec param, const fVec& grad, fVec& exp_avg, fVec& exp_avg_sq,
                             const VecCoeffs& k) {
  if (k.do_decay) {
    param = param * k.decay;
  }
  // exp_avg.lerp_(grad, 1 - beta1) as torch writes it: fma(w, g - m, m) for a small weight w,
  // else fma(w - 1, g - m, g) (torch selects with a uniform blendv; a branch is the same).
  const fVec base = k.lerp_small ? exp_avg : grad;
  exp_avg = at::vec::fmadd(k.lerp_coeff, grad - exp_avg, base);
  const fVec c2_grad = k.c2 * grad;
  exp_avg_sq = at::vec::fmadd(c2_grad, grad, exp_avg_sq * k.beta2);
  const fVec denom = (exp_avg_sq.sqrt() / k.bias_correction2_sqrt) + k.eps;
  return param + k.neg_step_size * exp_avg / denom;
}

// The moments as stored: stochastic rounding's (`rnd`: exp_avg takes the low 16 random bits,
// exp_avg_sq the high 16), or as they are (rounded to nearest-even by the store).
OFFLOAD_HOT fVec stored_exp_avg(const fVec& v, const iVec* rnd) {
  return rnd == nullptr ? v : sr_round(v, *rnd & iVec(0xFFFF));
}
OFFLOAD_HOT fVec stored_exp_avg_sq(const fVec& v, const iVec* rnd) {
  return rnd == nullptr ? v : sr_round(v, (*rnd >> iVec(16)) & iVec(0xFFFF));
}

// One AdamW update on the fp32 lanes of one vector at `s`; stores the moments and returns the new
// master.
template <bool NT = false, typename M = float>
OFFLOAD_HOT fVec adamw_vec(fVec param, fVec grad, const StatePtrs<M>& s, const VecCoeffs& k,
                           const iVec* rnd = nullptr) {
  fVec exp_avg = load_moments(s.exp_avg_in), exp_avg_sq = load_moments(s.exp_avg_sq_in);
  param = adamw_lanes(param, grad, exp_avg, exp_avg_sq, k);
  put_moments<NT>(s.exp_avg_out, stored_exp_avg(exp_avg, rnd));
  put_moments<NT>(s.exp_avg_sq_out, stored_exp_avg_sq(exp_avg_sq, rnd));
  return param;
}

// adamw_vec on two consecutive float vectors at `s` (masters p0, p1 in, new masters out), their
// moments loaded and stored two vectors at a time (bf16 on AVX-512: full 64-byte accesses).
// `rnd`: null, or the random bits of both vectors (stochastic rounding).
template <bool NT, typename M>
OFFLOAD_HOT void adamw_vec2(fVec& p0, fVec& p1, const fVec& g0, const fVec& g1,
                            const StatePtrs<M>& s, const VecCoeffs& k, const iVec* rnd) {
  fVec a0, a1, v0, v1;
  load_moments2(s.exp_avg_in, a0, a1);
  load_moments2(s.exp_avg_sq_in, v0, v1);
  p0 = adamw_lanes(p0, g0, a0, v0, k);
  p1 = adamw_lanes(p1, g1, a1, v1, k);
  const iVec* r1 = rnd == nullptr ? nullptr : rnd + 1;
  put_moments2<NT>(s.exp_avg_out, stored_exp_avg(a0, rnd), stored_exp_avg(a1, r1));
  put_moments2<NT>(s.exp_avg_sq_out, stored_exp_avg_sq(v0, rnd), stored_exp_avg_sq(v1, r1));
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

#else
// (DEFAULT builds: the previous text of adamw_vec, see OFFLOAD_VECTOR_BUILD.)
// One AdamW update on the fp32 lanes of one vector at `s`; stores the moments and returns the new
// master.
template <bool NT = false, typename M = float>
OFFLOAD_HOT fVec adamw_vec(fVec param, fVec grad, const StatePtrs<M>& s, const VecCoeffs& k,
                      const iVec* rnd = nullptr) {
  if (k.do_decay) {
    param = param * k.decay;
  }
  fVec exp_avg = load_moments(s.exp_avg_in);
  // exp_avg.lerp_(grad, 1 - beta1) as torch writes it: fma(w, g - m, m) for a small weight w,
  // else fma(w - 1, g - m, g) (torch selects with a uniform blendv; a branch is the same).
  const fVec base = k.lerp_small ? exp_avg : grad;
  exp_avg = at::vec::fmadd(k.lerp_coeff, grad - exp_avg, base);

  const fVec c2_grad = k.c2 * grad;
  const fVec exp_avg_sq = at::vec::fmadd(c2_grad, grad, load_moments(s.exp_avg_sq_in) * k.beta2);
  if (rnd != nullptr) {  // stochastic rounding: the stored moments only; the update uses these
    put_moments<NT>(s.exp_avg_out, sr_round(exp_avg, *rnd & iVec(0xFFFF)));
    put_moments<NT>(s.exp_avg_sq_out, sr_round(exp_avg_sq, (*rnd >> iVec(16)) & iVec(0xFFFF)));
  } else {
    put_moments<NT>(s.exp_avg_out, exp_avg);
    put_moments<NT>(s.exp_avg_sq_out, exp_avg_sq);
  }

  const fVec denom = (exp_avg_sq.sqrt() / k.bias_correction2_sqrt) + k.eps;
  return param + k.neg_step_size * exp_avg / denom;
}

#endif  // OFFLOAD_VECTOR_BUILD

// One element of the scalar tail. `in_block`: the element lies in the first multiple of
// kTailBlock tail elements (torch's vectorised tail loop), which fuses exp_avg_sq differently.
template <typename M>
inline float adamw_scalar(float param, float grad_val, const StatePtrs<M>& s, bool in_block,
                          const Coeffs& c, int64_t j = 0) {
  const int32_t h = c.sr ? sr_hash(c.sr_key, static_cast<uint32_t>(c.sr_index + j)) : 0;
  if (c.weight_decay != 0.f) {
    param = param * float(1 - c.lr * c.weight_decay);
  }
  float exp_avg = static_cast<float>(*s.exp_avg_in);
  const float lerp_weight = float(c.exp_avg_grad_coefficient);
  if (std::abs(lerp_weight) < float(0.5)) {
    exp_avg = madd(lerp_weight, grad_val - exp_avg, exp_avg);
  } else {
    // grad - (grad - exp_avg) * (1 - w) == fma(w - 1, grad - exp_avg, grad) exactly.
    exp_avg = madd(lerp_weight - float(1), grad_val - exp_avg, grad_val);
  }
  *s.exp_avg_out = static_cast<M>(c.sr ? sr_round_scalar(exp_avg, h & 0xFFFF) : exp_avg);  // bf16: nearest-even
  const float c2_grad = float(c.exp_avg_sq_grad_coefficient) * grad_val;
  float exp_avg_sq = static_cast<float>(*s.exp_avg_sq_in);
  if (in_block) {
    exp_avg_sq = madd(c2_grad, grad_val, exp_avg_sq * float(c.beta2));
  } else {
    exp_avg_sq = madd(exp_avg_sq, float(c.beta2), c2_grad * grad_val);
  }
  *s.exp_avg_sq_out = static_cast<M>(c.sr ? sr_round_scalar(exp_avg_sq, (h >> 16) & 0xFFFF) : exp_avg_sq);
  const float denom = std::sqrt(exp_avg_sq) / float(c.bias_correction2_sqrt) + float(c.eps);
  return param - float(c.step_size) * exp_avg / denom;
}

// An edit the version counters cannot see (see adamw_span's `seen`): lanes whose master rounded to
// the parameter's dtype differs in value from the weight `w` take the weight's value.
// bf16: the master is rounded in its 32-bit lanes (c10::BFloat16's round-to-nearest-even, without
// packing to 16 bits and back: a third of this check's cost in the step); a NaN master is never
// equal (it would round to NaN). fp16: F16C's conversions.
OFFLOAD_HOT fVec round_bf16_lanes(const fVec& m) {
  using iVec = at::vec::Vectorized<int32_t>;
  const iVec b = at::vec::cast<int32_t>(m);
  const iVec r = (b + (iVec(0x7FFF) + ((b >> iVec(16)) & iVec(1)))) & iVec(static_cast<int32_t>(0xFFFF0000u));
  return at::vec::cast<float>(r);
}

template <typename param_t>
OFFLOAD_HOT void follow_weights(const at::vec::Vectorized<param_t>& w, fVec& m0, fVec& m1) {
  const auto [w0, w1] = at::vec::convert_to_float<param_t>(w);
  if constexpr (std::is_same_v<param_t, c10::BFloat16>) {
    // equal (as values; not NaN): keep the master (its extra precision)
    m0 = fVec::blendv(w0, m0, (round_bf16_lanes(m0) == w0) & (m0 == m0));
    m1 = fVec::blendv(w1, m1, (round_bf16_lanes(m1) == w1) & (m1 == m1));
  } else {
    const auto [r0, r1] = at::vec::convert_to_float<param_t>(at::vec::convert_from_float<param_t>(m0, m1));
    m0 = fVec::blendv(w0, m0, r0 == w0);
    m1 = fVec::blendv(w1, m1, r1 == w1);
  }
}

// The checksum words of a span's gradient (defined with the checksum below).
template <typename grad_t>
struct WordSums;

// Updates `size` consecutive elements. `size` is a multiple of kUnit except at a tensor's end.
// `st`: where the state is read and written (StatePtrs); `NT`: its new values are streamed.
// `Sum`: the words of the gradient it consumes go into `sums` (WordSums), from the same loads.
// `seen`: null, or the weights as they are now (the live parameter; may be `param_lowp` itself):
// an element whose master does not round to its weight (an edit the version counters cannot see:
// `p.data.clamp_()`) first takes the weight's value as its master, exactly as
// offload/state/_edits.py's reseed (compared as values: +0 == -0, a NaN never equal); with `Sum`
// the weight's words go into `sums` too, from the same loads.
template <typename param_t, typename grad_t, bool NT = false, bool Sum = false, typename M = float>
void adamw_span(param_t* param_lowp, const grad_t* grad, const StatePtrs<M>& st, int64_t size,
                const Coeffs& c, bool stream, const GradXform& x,
                WordSums<grad_t>* sums = nullptr, const param_t* seen = nullptr) {
  using pVec = at::vec::Vectorized<param_t>;
  using gVec = at::vec::Vectorized<grad_t>;
  static_assert(pVec::size() == 2 * fVec::size() && gVec::size() == 2 * fVec::size(),
                "a low-precision vector must hold two float vectors");
  constexpr int64_t kW = fVec::size();
  const VecCoeffs k(c);
#if OFFLOAD_VECTOR_BUILD
  // A full low-precision vector of gradients as two float vectors (exact).
  const auto grads_of = [](const gVec& raw, fVec& g0, fVec& g1) OFFLOAD_HOT_LAMBDA {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<grad_t, c10::BFloat16>) {
      unpack_bf16(__m512i(raw), g0, g1);
      return;
    }
#endif
    std::tie(g0, g1) = at::vec::convert_to_float<grad_t>(raw);
  };
  // Two float vectors: one full low-precision load of the gradient, one of the new parameter.
  auto pair = [&](int64_t d) OFFLOAD_HOT_LAMBDA {
    prefetch_ahead(grad, st, d, seen);
    fVec g0, g1;
    const gVec raw = gVec::loadu(grad + d);
    if constexpr (Sum) sums->add_lowp(raw, d);  // the words of the very load the update uses
    grads_of(raw, g0, g1);
    if (x.any()) xform_pair<grad_t>(g0, g1, x);
    const StatePtrs<M> s0 = st.at(d), s1 = st.at(d + kW);
    fVec p0 = fVec::loadu(s0.master_in), p1 = fVec::loadu(s1.master_in);
    if (seen != nullptr) {
      const pVec w = pVec::loadu(seen + d);
      if constexpr (Sum) sums->add_lowp(w, d);
      follow_weights<param_t>(w, p0, p1);
    }
    if (c.sr) {
      const iVec r[2] = {sr_hash_vec(c.sr_key, c.sr_index + d), sr_hash_vec(c.sr_key, c.sr_index + d + kW)};
      adamw_vec2<NT>(p0, p1, g0, g1, s0, k, r);
    } else {
      adamw_vec2<NT>(p0, p1, g0, g1, s0, k, nullptr);
    }
    put<NT>(s0.master_out, p0);
    put<NT>(s1.master_out, p1);
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<param_t, c10::BFloat16>) return pVec(pack_bf16(p0, p1));
#endif
    return at::vec::convert_from_float<param_t>(p0, p1);
  };
#else  // (the previous text, see OFFLOAD_VECTOR_BUILD)
  // Two float vectors: one full low-precision load of the gradient, one of the new parameter.
  auto pair = [&](int64_t d) {
    fVec g0, g1;
    if constexpr (Sum) {  // one load: its words checksummed, its values updated (exact conversion)
      const gVec raw = gVec::loadu(grad + d);
      sums->add_lowp(raw, d);
      std::tie(g0, g1) = at::vec::convert_to_float<grad_t>(raw);
    } else {
      at::vec::load_to_float<grad_t>(grad + d, g0, g1);
    }
    if (x.any()) xform_pair<grad_t>(g0, g1, x);
    const StatePtrs<M> s0 = st.at(d), s1 = st.at(d + kW);
    fVec m0 = fVec::loadu(s0.master_in), m1 = fVec::loadu(s1.master_in);
    if (seen != nullptr) {
      const pVec w = pVec::loadu(seen + d);
      if constexpr (Sum) sums->add_lowp(w, d);
      follow_weights<param_t>(w, m0, m1);
    }
    fVec p0, p1;
    if (c.sr) {
      const iVec r0 = sr_hash_vec(c.sr_key, c.sr_index + d), r1 = sr_hash_vec(c.sr_key, c.sr_index + d + kW);
      p0 = adamw_vec<NT>(m0, g0, s0, k, &r0);
      p1 = adamw_vec<NT>(m1, g1, s1, k, &r1);
    } else {
      p0 = adamw_vec<NT>(m0, g0, s0, k);
      p1 = adamw_vec<NT>(m1, g1, s1, k);
    }
    put<NT>(s0.master_out, p0);
    put<NT>(s1.master_out, p1);
    return at::vec::convert_from_float<param_t>(p0, p1);
  };
#endif
  int64_t d = 0;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  // The low-precision parameter is only written: in a call too large for the caches, stream it
  // past them (no read for ownership: 2 of 30 bytes per element) when the span starts on a
  // vector boundary, as slab views normally do. Values are the same either way.
  if (stream && reinterpret_cast<uintptr_t>(param_lowp) % sizeof(pVec) == 0) {
    for (; d + 2 * kW <= size; d += 2 * kW) {
#if defined(CPU_CAPABILITY_AVX512)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(param_lowp + d), __m512i(pair(d)));
#else
      _mm256_stream_si256(reinterpret_cast<__m256i*>(param_lowp + d), __m256i(pair(d)));
#endif
    }
    _mm_sfence();
  }
#endif
  for (; d + 2 * kW <= size; d += 2 * kW) {
    pair(d).store(param_lowp + d);
  }
  // At most one more full float vector (same lane arithmetic as above).
  if (d + kW <= size) {
    fVec g0;
    if constexpr (Sum) {
      const gVec raw = gVec::loadu(grad + d, kW);  // the other lanes are zero words
      sums->add_lowp(raw, d);
      g0 = std::get<0>(at::vec::convert_to_float<grad_t>(raw));
    } else {
      at::vec::load_to_float<grad_t>(grad + d, g0);
    }
    if (x.any()) xform_one<grad_t>(g0, x);
    const StatePtrs<M> s0 = st.at(d);
    fVec m0 = fVec::loadu(s0.master_in);
    if (seen != nullptr) {
      const pVec w = pVec::loadu(seen + d, kW);  // the other lanes are zero words
      if constexpr (Sum) sums->add_lowp(w, d);
      fVec m1 = m0;
      follow_weights<param_t>(w, m0, m1);
    }
    const iVec r0 = c.sr ? sr_hash_vec(c.sr_key, c.sr_index + d) : iVec(0);
    const fVec p0 = adamw_vec<NT>(m0, g0, s0, k, c.sr ? &r0 : nullptr);
    put<NT>(s0.master_out, p0);
    at::vec::convert_from_float<param_t>(p0, p0).store(param_lowp + d, kW);
    d += kW;
  }
  const int64_t block_end = d + (kHasFma ? (size - d) / kTailBlock * kTailBlock : 0);
  for (; d < size; ++d) {
    const grad_t gv = grad[d];
    if constexpr (Sum) sums->add_words(&gv, d, 1);
    const float g = x.any() ? xform_scalar<grad_t>(static_cast<float>(gv), x)
                            : static_cast<float>(gv);
    const StatePtrs<M> s = st.at(d);
    float m = *s.master_in;
    if (seen != nullptr) {
      const param_t w = seen[d];
      if constexpr (Sum) sums->add_words(reinterpret_cast<const grad_t*>(&w), d, 1);
      if (!(static_cast<float>(static_cast<param_t>(m)) == static_cast<float>(w))) m = static_cast<float>(w);
    }
    const float p = adamw_scalar(m, g, s, d < block_end, c, d);
    *s.master_out = p;
    param_lowp[d] = static_cast<param_t>(p);  // round to nearest even, like Tensor.to()
  }
}

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

// ---- grad_stats: per-tensor norm terms and content checksums (offload/kernels/_grad_stats.py) ------
//
// One read of every element: per tensor, its norm term in double (sum of g^2, sum of |g|, or
// max |g|) and the wrapping 64-bit sum of its words (fp32: the 32-bit word as a signed int, as
// `g.view(torch.int32).sum(dtype=torch.int64)`; bf16/fp16: the 16-bit word zero-extended).
// Determinism: a tensor is cut into blocks of kStatsBlock elements counted from its first element
// (in memory order); a block is reduced into kStatsLanes lanes (element e of the block goes to lane
// e % kStatsLanes, in element order), the lanes are added in lane order, and a tensor's blocks in
// block order after the parallel pass. Nothing depends on the thread count, on which thread took a
// block, or on the other tensors of the call. g^2 of an fp32/bf16/fp16 value is exact in double.

// Elements per block (64 KB of fp32): the unit of work and of the fixed summation order.
constexpr int64_t kStatsBlock = int64_t(1) << 14;
// Independent accumulators per block (eight 256-bit double vectors: hides the FMA latency).
constexpr int kStatsLanes = 32;
static_assert(kStatsLanes % fVec::size() == 0, "lanes must hold whole float vectors");
// 16-bit words (and the low halves of 32-bit ones) are summed in 32-bit lanes: at most
// kStatsBlock / kStatsLanes (+1 from the tail) of 0xFFFF each; high halves likewise, signed.
static_assert((kStatsBlock / kStatsLanes) * 0xFFFFull < (1ull << 32), "32-bit lane overflow");
// How far ahead of the loads the vector loop prefetches (one read stream per thread leaves the
// hardware prefetcher short of requests in flight on the VM this was measured on).
constexpr int64_t kStatsPrefetchBytes = 2048;
// Blocks a thread takes from the shared counter at a time (256 KB of fp32; read side by side).
constexpr int64_t kStatsTake = 4;
// Elements per worker below which more threads cost more than they bring (a parallel region
// costs microseconds to start, and a thread of a loaded machine may be scheduled late).
constexpr int64_t kStatsGrain = int64_t(1) << 17;

// kNormNone: the checksum alone (speculation checks need no norm: no float-to-double work).
enum NormKind : int64_t { kNormL2 = 0, kNormL1 = 1, kNormInf = 2, kNormNone = 3 };

// The checksum weighs lane j (element i of a tensor lies in lane i % 32) by an odd 64-bit
// constant, so that flipping signs (a sign bit moves a word by 2^31) or swapping neighbours does
// not cancel out as it does in a plain sum of words (offload/kernels/_grad_stats.py: LANE_WEIGHTS).
// (splitmix64: defined with stochastic rounding's keys above.)
constexpr uint64_t lane_weight(int j) { return splitmix64(static_cast<uint64_t>(j)) | 1ull; }

struct BlockStats {
  double term = 0.0;
  uint64_t sum = 0;
};

template <typename T>
inline uint64_t word_of(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    int32_t w;
    std::memcpy(&w, p, sizeof(w));
    return static_cast<uint64_t>(static_cast<int64_t>(w));  // sign-extended, as view(int32)
  } else {
    uint16_t w;
    std::memcpy(&w, p, sizeof(w));
    return w;  // zero-extended
  }
}

template <typename T, int64_t K>
inline void lane_update(double& acc, float& mx, uint32_t& bad, float f) {
  if constexpr (K == kNormNone) {
    return;
  } else if constexpr (K == kNormL2) {
    const double v = static_cast<double>(f);
    acc = acc + v * v;
  } else if constexpr (K == kNormL1) {
    acc = acc + std::abs(static_cast<double>(f));
  } else {
    const float a = std::abs(f);
    mx = mx < a ? a : mx;
    bad |= static_cast<uint32_t>(f != f);
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// 32 elements into the 32 lanes: acc[k] holds lanes 4k..4k+3 (element e of the group is lane e),
// exactly the scalar lane_update's operations (fma(v, v, acc) == acc + v * v: the square of a
// float is exact in double). Words: a 16-bit word into its 32-bit lane of s32; a 32-bit word w as
// w & 0xFFFF into s32 and w >> 16 (arithmetic) into hi32, so that the sum of the words is
// sum(s32) + 65536 * sum(hi32) (no lane can overflow within one block), with no cross-lane
// widening. 256-bit vectors on AVX-512 builds too: on the 2-core VM (Xeon, AVX-512) the 512-bit
// float-to-double conversions ran this loop at 5-16 GB/s from L1/L2, the 256-bit ones at 40-58
// GB/s (a standalone loop over 64 KB, best of 5), since 512-bit work has two ports, 256-bit three.
template <typename T, int64_t K>
inline void stats_vec32(const T* x, __m256d (&acc)[8], __m256i (&s32)[4], __m256i (&hi32)[4]) {
  const __m256d sign = _mm256_set1_pd(-0.0);
  for (int h = 0; h < 4; ++h) {
    [[maybe_unused]] __m256 f;
    if constexpr (std::is_same_v<T, float>) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 8 * h));
      s32[h] = _mm256_add_epi32(s32[h], _mm256_and_si256(w, _mm256_set1_epi32(0xFFFF)));
      hi32[h] = _mm256_add_epi32(hi32[h], _mm256_srai_epi32(w, 16));
    } else {
      const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + 8 * h));
      const __m256i w32 = _mm256_cvtepu16_epi32(w);
      s32[h] = _mm256_add_epi32(s32[h], w32);
      if constexpr (K == kNormNone) {
        continue;
      } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
        f = _mm256_castsi256_ps(_mm256_slli_epi32(w32, 16));
      } else {
        #if defined(CPU_CAPABILITY_AVX512)  // no -mf16c there: the AVX-512 conversion, low half
        f = _mm512_castps512_ps256(_mm512_cvtph_ps(_mm256_castsi128_si256(w)));
#else
        f = _mm256_cvtph_ps(w);
#endif
      }
    }
    if constexpr (K == kNormNone) continue;
    for (int q = 0; q < 2; ++q) {
      __m256d v;
      if constexpr (std::is_same_v<T, float>) {
        v = _mm256_cvtps_pd(_mm_loadu_ps(x + 8 * h + 4 * q));
      } else {
        v = _mm256_cvtps_pd(q == 0 ? _mm256_castps256_ps128(f) : _mm256_extractf128_ps(f, 1));
      }
      __m256d& a = acc[2 * h + q];
      if constexpr (K == kNormL2) {
        a = _mm256_fmadd_pd(v, v, a);
      } else {
        a = _mm256_add_pd(a, _mm256_andnot_pd(sign, v));
      }
    }
  }
}
#endif

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The vector accumulators of one block (see stats_vec32).
struct VecStats {
  __m256d va[8];
  __m256i v32[4], vhi[4];

  VecStats() {
    for (auto& a : va) a = _mm256_setzero_pd();
    for (auto& a : v32) a = _mm256_setzero_si256();
    for (auto& a : vhi) a = _mm256_setzero_si256();
  }
};

// Elements [i, end) of a block (multiples of kStatsLanes) into its vector accumulators.
template <typename T, int64_t K>
inline void stats_vec_range(const T* x, int64_t i, int64_t end, VecStats& st) {
  __m256d va[8];
  __m256i v32[4], vhi[4];
  for (int k = 0; k < 8; ++k) va[k] = st.va[k];
  for (int k = 0; k < 4; ++k) {
    v32[k] = st.v32[k];
    vhi[k] = st.vhi[k];
  }
  for (; i < end; i += kStatsLanes) {
    const char* ahead = reinterpret_cast<const char*>(x + i) + kStatsPrefetchBytes;
    _mm_prefetch(ahead, _MM_HINT_T0);
    if constexpr (sizeof(T) == 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
    stats_vec32<T, K>(x + i, va, v32, vhi);
  }
  for (int k = 0; k < 8; ++k) st.va[k] = va[k];
  for (int k = 0; k < 4; ++k) {
    st.v32[k] = v32[k];
    st.vhi[k] = vhi[k];
  }
}
#endif

// The rest of a block from element i (a multiple of kStatsLanes) with the scalar lanes, and the
// block's result: lanes added in lane order. `vec`: the vector accumulators of elements [0, i),
// or null (none ran).
template <typename T, int64_t K>
BlockStats block_stats_finish(const T* x, int64_t n, int64_t i, const void* vec) {
  alignas(64) double acc[kStatsLanes] = {};
  float mx[kStatsLanes] = {};
  uint32_t bad[kStatsLanes] = {};
  alignas(64) uint64_t s64[kStatsLanes] = {};
  alignas(64) uint32_t s32[kStatsLanes] = {};
  alignas(64) int32_t hi32[kStatsLanes] = {};
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (vec != nullptr) {
    const VecStats& st = *static_cast<const VecStats*>(vec);
    for (int k = 0; k < 8; ++k) _mm256_store_pd(acc + 4 * k, st.va[k]);
    for (int k = 0; k < 4; ++k) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(s32 + 8 * k), st.v32[k]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(hi32 + 8 * k), st.vhi[k]);
    }
  }
#endif
  for (; i + kStatsLanes <= n; i += kStatsLanes) {  // inf norms, and builds without AVX2
    for (int j = 0; j < kStatsLanes; ++j) {
      if constexpr (std::is_same_v<T, float>) {
        s64[j] += word_of(x + i + j);
      } else {
        s32[j] += static_cast<uint32_t>(word_of(x + i + j));
      }
      lane_update<T, K>(acc[j], mx[j], bad[j], static_cast<float>(x[i + j]));
    }
  }
  for (int j = 0; i < n; ++i, ++j) {  // the tail: lane j, the same operations one at a time
    if constexpr (std::is_same_v<T, float>) {
      s64[j] += word_of(x + i);
    } else {
      s32[j] += static_cast<uint32_t>(word_of(x + i));
    }
    lane_update<T, K>(acc[j], mx[j], bad[j], static_cast<float>(x[i]));
  }
  BlockStats out;
  float m = 0.0f;
  uint32_t any_bad = 0;
  for (int j = 0; j < kStatsLanes; ++j) {
    out.term += acc[j];
    out.sum += (s64[j] + s32[j] + (static_cast<uint64_t>(static_cast<int64_t>(hi32[j])) << 16)) *
               lane_weight(j);
    m = m < mx[j] ? mx[j] : m;
    any_bad |= bad[j];
  }
  if constexpr (K == kNormInf) {
    out.term = any_bad ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(m);
  }
  return out;
}

template <typename T, int64_t K>
BlockStats block_stats(const T* x, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (K != kNormInf) {
    VecStats st;
    const int64_t end = n / kStatsLanes * kStatsLanes;
    stats_vec_range<T, K>(x, 0, end, st);
    return block_stats_finish<T, K>(x, n, end, &st);
  }
#endif
  return block_stats_finish<T, K>(x, n, 0, nullptr);
}

// Blocks read side by side: up to kStatsStreams blocks of one tensor (x + k * kStatsBlock, the
// last one `last_n` elements), kStatsSlice elements of each in turn. One read stream per thread
// leaves the memory bus short of requests in flight on the VM this was measured on (the step
// kernel reads seven); several streams keep more misses outstanding. Each block keeps its own
// accumulators and order, so its result is the bits block_stats gives it. Measured (50M, 2
// threads, 13 interleaved rounds, medians, against the fp32 step kernel's 46-47 GB/s in the same
// rounds): one stream fp32 21 GB/s, bf16 15; 4 streams of 128-element slices 28.9 and 20.2. Tried
// and worse: slices of 64, 256, 1024, 4096; 2 or 8 streams; a second software prefetch 8-128 KB
// ahead (alone +20%, with the streams a loss).
constexpr int kStatsStreams = 4;
constexpr int64_t kStatsSlice = 128;
static_assert(kStatsSlice % kStatsLanes == 0, "a slice must hold whole lane groups");

template <typename T, int64_t K>
void blocks_side_by_side(const T* x, int count, int64_t last_n, BlockStats* out) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (K != kNormInf) {
    VecStats st[kStatsStreams];
    int64_t end[kStatsStreams];
    for (int k = 0; k < count; ++k) {
      const int64_t n = k + 1 == count ? last_n : kStatsBlock;
      end[k] = n / kStatsLanes * kStatsLanes;
    }
    for (int64_t at = 0; at < kStatsBlock; at += kStatsSlice) {
      for (int k = 0; k < count; ++k) {
        const int64_t stop = std::min(end[k], at + kStatsSlice);
        if (at < stop) stats_vec_range<T, K>(x + k * kStatsBlock, at, stop, st[k]);
      }
    }
    for (int k = 0; k < count; ++k) {
      const int64_t n = k + 1 == count ? last_n : kStatsBlock;
      out[k] = block_stats_finish<T, K>(x + k * kStatsBlock, n, end[k], &st[k]);
    }
    return;
  }
#endif
  for (int k = 0; k < count; ++k) {
    out[k] = block_stats<T, K>(x + k * kStatsBlock, k + 1 == count ? last_n : kStatsBlock);
  }
}

template <int64_t K>
void blocks_side_by_side_of(at::ScalarType dtype, const void* base, int64_t lo, int count,
                            int64_t last_n, BlockStats* out) {
  switch (dtype) {
    case at::kFloat:
      return blocks_side_by_side<float, K>(static_cast<const float*>(base) + lo, count, last_n, out);
    case at::kBFloat16:
      return blocks_side_by_side<c10::BFloat16, K>(static_cast<const c10::BFloat16*>(base) + lo,
                                                   count, last_n, out);
    default:
      return blocks_side_by_side<c10::Half, K>(static_cast<const c10::Half*>(base) + lo, count,
                                               last_n, out);
  }
}

template <int64_t K>
BlockStats block_stats_of(at::ScalarType dtype, const void* base, int64_t lo, int64_t hi) {
  switch (dtype) {
    case at::kFloat: return block_stats<float, K>(static_cast<const float*>(base) + lo, hi - lo);
    case at::kBFloat16:
      return block_stats<c10::BFloat16, K>(static_cast<const c10::BFloat16*>(base) + lo, hi - lo);
    default: return block_stats<c10::Half, K>(static_cast<const c10::Half*>(base) + lo, hi - lo);
  }
}

// The checksum words of the gradient a span consumes, taken from the registers the update reads
// (so what is checksummed is exactly what is consumed, even while another thread writes the
// gradient: no second read of memory). Lane j of 32 holds the wrapping sum of the words of the
// elements e with e % 32 == j (a span starts on a multiple of kUnit, so `d % 32` is that lane):
// fp32 words sign-extended into 64-bit lanes, 16-bit words zero-extended into 32-bit lanes (a
// call covers at most kStatsBlock elements: 512 words of at most 0xFFFF per lane). `weighted()`
// is then grad_stats' checksum of the span (see below), whatever vector width added the words.
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

// ---- validation (all of it runs before the first write) -------------------------------------

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

// `fn`: the entry point's name, which every message starts with.
void check_tensor(const char* fn, const at::Tensor& t, const char* arg, size_t i, int64_t numel,
                  at::ScalarType dtype) {
  // The message prefix is built only on failure: this runs five times per tensor per call.
  const auto where = [&]() {
    std::ostringstream out;
    out << fn << ": " << arg << "[" << i << "]";
    return out.str();
  };
  if (!t.defined()) fail_value(where() + " is an undefined tensor");
  if (t.device().type() != c10::DeviceType::CPU) {
    fail_value(where() + " is on device " + t.device().str() + ": expected a CPU tensor");
  }
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

// ---- entry point ----------------------------------------------------------------------------

template <typename param_t, typename grad_t, typename M>
void run(const std::vector<at::Tensor>& params_lowp, const std::vector<at::Tensor>& grads_lowp,
         const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
         const std::vector<at::Tensor>& exp_avg_sqs, const std::vector<Coeffs>& coeffs,
         const GradXform& x, const Speculate* spec, const std::vector<at::Tensor>& seen) {
  const size_t n = masters.size();
  std::vector<param_t*> p_lp(n);
  std::vector<const param_t*> w_lp(n, nullptr);
  std::vector<const grad_t*> g_lp(n);
  std::vector<float*> m32(n);
  std::vector<M*> ea(n), eas(n);
  std::vector<int64_t> numel(n);
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    p_lp[i] = params_lowp[i].mutable_data_ptr<param_t>();
    g_lp[i] = grads_lowp[i].const_data_ptr<grad_t>();
    m32[i] = masters[i].mutable_data_ptr<float>();
    ea[i] = exp_avgs[i].mutable_data_ptr<M>();
    eas[i] = exp_avg_sqs[i].mutable_data_ptr<M>();
    numel[i] = masters[i].numel();
    total += numel[i];
    if (!seen.empty()) w_lp[i] = seen[i].const_data_ptr<param_t>();
  }
  const bool stream = total >= kStreamMinElements;
  for_each_span(numel, [&](size_t i, int64_t lo, int64_t hi) {
    const StatePtrs<M> st = state_ptrs<M>(spec, i, m32[i], ea[i], eas[i]);
    const bool nt = streamable(st.at(lo));
    speculated<grad_t>(spec, i, lo, hi, [&](int64_t a, int64_t b, WordSums<grad_t>* sums) {
      const grad_t* g = g_lp[i] + a;
      const param_t* w = w_lp[i] == nullptr ? nullptr : w_lp[i] + a;
      Coeffs ca = coeffs[i];
      ca.sr_index += a;  // (stochastic rounding: element indices count from the span)
      if (sums != nullptr && nt) {
        adamw_span<param_t, grad_t, true, true, M>(p_lp[i] + a, g, st.at(a), b - a, ca, stream, x, sums, w);
      } else if (sums != nullptr) {
        adamw_span<param_t, grad_t, false, true, M>(p_lp[i] + a, g, st.at(a), b - a, ca, stream, x, sums, w);
      } else if (nt) {
        adamw_span<param_t, grad_t, true, false, M>(p_lp[i] + a, g, st.at(a), b - a, ca, stream, x, nullptr, w);
      } else {
        adamw_span<param_t, grad_t, false, false, M>(p_lp[i] + a, g, st.at(a), b - a, ca, stream, x, nullptr, w);
      }
    });
    if (nt) fence_streams();
  });
}

// The moments' dtype of a call: torch.float32, or torch.bfloat16 (state_dtype=torch.bfloat16),
// the same for every exp_avg and exp_avg_sq (checked with the tensors).
at::ScalarType moments_dtype(const char* fn, const std::vector<at::Tensor>& exp_avgs) {
  if (exp_avgs.empty() || !exp_avgs[0].defined()) return at::kFloat;
  const at::ScalarType t = exp_avgs[0].scalar_type();
  if (t != at::kFloat && t != at::kBFloat16) {
    fail_type(std::string(fn) + ": exp_avgs[0] has dtype " + dtype_name(t) +
              ": expected torch.float32 or torch.bfloat16 (the same for every moment of the call)");
  }
  return t;
}

// Checks the five tensor lists (everything but the steps); returns the parameter and gradient
// dtypes. Writes nothing.
std::pair<at::ScalarType, at::ScalarType> check_lists(
    const char* fn, const std::vector<at::Tensor>& params_lowp, const std::vector<at::Tensor>& grads_lowp,
    const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
    const std::vector<at::Tensor>& exp_avg_sqs) {
  const size_t n = masters.size();
  const std::vector<std::pair<const char*, const std::vector<at::Tensor>*>> lists = {
      {"params_lowp", &params_lowp}, {"grads_lowp", &grads_lowp},
      {"exp_avgs", &exp_avgs},       {"exp_avg_sqs", &exp_avg_sqs}};
  for (const auto& [name, list] : lists) {
    if (list->size() != n) {
      std::ostringstream msg;
      msg << fn << ": " << name << " has " << list->size()
          << " tensors: expected " << n << " like masters";
      fail_value(msg.str());
    }
  }
  if (n == 0) return {at::kBFloat16, at::kBFloat16};

  const at::ScalarType p_dtype = params_lowp[0].defined() ? params_lowp[0].scalar_type()
                                                          : at::kBFloat16;
  const at::ScalarType g_dtype = grads_lowp[0].defined() ? grads_lowp[0].scalar_type()
                                                         : at::kBFloat16;
  for (const auto& [name, dt] : {std::pair{"params_lowp", p_dtype},
                                 std::pair{"grads_lowp", g_dtype}}) {
    if (dt != at::kBFloat16 && dt != at::kHalf) {
      fail_type(std::string(fn) + ": " + name + "[0] has dtype " + dtype_name(dt) +
                ": expected torch.bfloat16 or torch.float16 (the same for the whole list)");
    }
  }
  const at::ScalarType m_dtype = moments_dtype(fn, exp_avgs);
  for (size_t i = 0; i < n; ++i) {
    if (!masters[i].defined()) fail_value(std::string(fn) + ": masters[" + std::to_string(i) +
                                          "] is an undefined tensor");
    const int64_t numel = masters[i].numel();
    check_tensor(fn, masters[i], "masters", i, numel, at::kFloat);
    check_tensor(fn, exp_avgs[i], "exp_avgs", i, numel, m_dtype);
    check_tensor(fn, exp_avg_sqs[i], "exp_avg_sqs", i, numel, m_dtype);
    check_tensor(fn, params_lowp[i], "params_lowp", i, numel, p_dtype);
    check_tensor(fn, grads_lowp[i], "grads_lowp", i, numel, g_dtype);
    check_no_overlap(fn, {span_of(params_lowp[i], "params_lowp"), span_of(grads_lowp[i], "grads_lowp"),
                      span_of(masters[i], "masters"), span_of(exp_avgs[i], "exp_avgs"),
                      span_of(exp_avg_sqs[i], "exp_avg_sqs")},
                     i);
  }
  return {p_dtype, g_dtype};
}

// After every check: bumps the version counters of the tensors written (in-place semantics for
// autograd, as torch's own in-place ops). Raises, still before any write, for inference tensors
// outside InferenceMode.
// `in_place`: the state tensors are written (no `into`); out of place they are only read, and
// keep their versions (an own master, the parameter itself, must not look edited).
void bump_versions(const std::vector<at::Tensor>& params_lowp,
                   const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                   const std::vector<at::Tensor>& exp_avg_sqs,
                   const std::vector<at::Tensor>& steps = {}, bool in_place = true) {
  for (size_t i = 0; i < masters.size(); ++i) {
    params_lowp[i].unsafeGetTensorImpl()->bump_version();
    if (!in_place) continue;
    for (const at::Tensor* t : {&masters[i], &exp_avgs[i], &exp_avg_sqs[i]}) {
      t->unsafeGetTensorImpl()->bump_version();
    }
  }
  for (const at::Tensor& t : steps) t.unsafeGetTensorImpl()->bump_version();
}

// `seen` (see adamw_span): empty, or per tensor the weights as they are now, of the parameters'
// dtype and size: `params_lowp[i]` itself, or a tensor apart from it and from the other operands.
// Only read.
void check_seen(const char* fn, const std::vector<at::Tensor>& seen,
                const std::vector<at::Tensor>& params_lowp, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                const std::vector<at::Tensor>& exp_avg_sqs, at::ScalarType p_dtype) {
  if (seen.empty()) return;
  const size_t n = masters.size();
  if (seen.size() != n) {
    std::ostringstream msg;
    msg << fn << ": seen has " << seen.size() << " tensors: expected 0 or " << n << " like masters";
    fail_value(msg.str());
  }
  for (size_t i = 0; i < n; ++i) {
    check_tensor(fn, seen[i], "seen", i, masters[i].numel(), p_dtype);
    const Span w = span_of(seen[i], "seen"), out = span_of(params_lowp[i], "params_lowp");
    const bool same = w.begin == out.begin && w.end == out.end;
    check_no_overlap(fn, {w, span_of(grads[i], "grads_lowp"), span_of(masters[i], "masters"),
                          span_of(exp_avgs[i], "exp_avgs"), span_of(exp_avg_sqs[i], "exp_avg_sqs")},
                     i);
    if (!same) check_no_overlap(fn, {w, out, Span{0, 0, ""}, Span{0, 0, ""}, Span{0, 0, ""}}, i);
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

// The update itself, with the GIL released.
template <typename M>
void update_as(const std::vector<at::Tensor>& params_lowp, const std::vector<at::Tensor>& grads_lowp,
               const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
               const std::vector<at::Tensor>& exp_avg_sqs, at::ScalarType p_dtype,
               at::ScalarType g_dtype, const std::vector<Coeffs>& coeffs, const GradXform& x,
               const Speculate* spec, const std::vector<at::Tensor>& seen) {
  if (p_dtype == at::kBFloat16 && g_dtype == at::kBFloat16) {
    run<c10::BFloat16, c10::BFloat16, M>(params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs,
                                         coeffs, x, spec, seen);
  } else if (p_dtype == at::kBFloat16) {
    run<c10::BFloat16, c10::Half, M>(params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, coeffs,
                                     x, spec, seen);
  } else if (g_dtype == at::kBFloat16) {
    run<c10::Half, c10::BFloat16, M>(params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, coeffs,
                                     x, spec, seen);
  } else {
    run<c10::Half, c10::Half, M>(params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, coeffs, x,
                                 spec, seen);
  }
}

void update(const std::vector<at::Tensor>& params_lowp, const std::vector<at::Tensor>& grads_lowp,
            const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
            const std::vector<at::Tensor>& exp_avg_sqs, at::ScalarType p_dtype,
            at::ScalarType g_dtype, const std::vector<Coeffs>& coeffs,
            const GradXform& x = GradXform{}, const Speculate* spec = nullptr,
            const std::vector<at::Tensor>& seen = {}) {
  if (masters.empty()) return;
  pybind11::gil_scoped_release no_gil;
  if (exp_avgs[0].scalar_type() == at::kBFloat16) {
    update_as<c10::BFloat16>(params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, p_dtype, g_dtype,
                             coeffs, x, spec, seen);
  } else {
    update_as<float>(params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, p_dtype, g_dtype, coeffs,
                     x, spec, seen);
  }
}

// One step number for every tensor (validated in Python: an int >= 1).
void fused_mp_adamw_(const std::vector<at::Tensor>& params_lowp,
                     const std::vector<at::Tensor>& grads_lowp,
                     const std::vector<at::Tensor>& masters,
                     const std::vector<at::Tensor>& exp_avgs,
                     const std::vector<at::Tensor>& exp_avg_sqs, int64_t step, double lr,
                     double beta1, double beta2, double eps, double weight_decay) {
  const auto [p_dtype, g_dtype] =
      check_lists("fused_mp_adamw_", params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs);
  if (masters.empty()) return;
  // torch keeps the step in a float tensor: the int goes through float as it would there.
  const std::vector<Coeffs> coeffs(
      masters.size(),
      make_coeffs(static_cast<float>(step), lr, beta1, beta2, eps, weight_decay));
  bump_versions(params_lowp, masters, exp_avgs, exp_avg_sqs);
  update(params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, p_dtype, g_dtype, coeffs);
}

// Checks a 0-d (or one-element) fp32 CPU step tensor.
void check_step(const char* fn, const at::Tensor& t, const char* arg, size_t i) {
  const auto where = [&]() {
    std::ostringstream out;
    out << fn << ": " << arg << "[" << i << "]";
    return out.str();
  };
  if (!t.defined()) fail_value(where() + " is an undefined tensor");
  if (t.device().type() != c10::DeviceType::CPU) {
    fail_value(where() + " is on device " + t.device().str() + ": expected a CPU tensor");
  }
  if (t.layout() != c10::kStrided || t.numel() != 1) {
    std::ostringstream msg;
    msg << where() << " has shape " << t.sizes() << ": expected a one-element step tensor";
    fail_value(msg.str());
  }
  if (t.scalar_type() != at::kFloat) {
    fail_type(where() + " has dtype " + dtype_name(t.scalar_type()) +
              ": expected torch.float32 (torch's AdamW step tensor)");
  }
}

// The steps of one call: checks every step tensor and computes each tensor's coefficients from
// the value its step tensor holds after adding one to each of `steps_to_increment` (as
// torch._foreach_add_(steps, 1) does before the fused call). Writes nothing: the increments are
// returned in `incremented` (by address), for the caller to store once every check passed. A
// storage listed twice (the same tensor, or two views of one element) goes up twice, as with
// _foreach_add_. mutable_data_ptr materialises a copy-on-write storage (values unchanged), so a
// lazily cloned step tensor never shares the address its original is incremented at.
// state_rounding="stochastic" (see sr_key): per tensor its parameter's slot and the index of its
// first element in that parameter; the moments must be bf16. Checked before any write.
void stochastic_rounding(const char* fn, std::vector<Coeffs>& coeffs, const std::optional<int64_t>& seed,
                         const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
                         at::ScalarType m_dtype) {
  if (!seed.has_value()) {
    if (!slots.empty() || !starts.empty()) fail_value(std::string(fn) + ": sr_slots/sr_starts without sr_seed");
    return;
  }
  if (m_dtype != at::kBFloat16 && !coeffs.empty()) {
    fail_value(std::string(fn) + ": sr_seed (stochastic rounding) with moments of dtype " + dtype_name(m_dtype) +
               ": expected torch.bfloat16 moments");
  }
  if (slots.size() != coeffs.size() || starts.size() != coeffs.size()) {
    std::ostringstream msg;
    msg << fn << ": sr_slots has " << slots.size() << " and sr_starts " << starts.size()
        << " entries: expected " << coeffs.size() << " (one per tensor)";
    fail_value(msg.str());
  }
  for (size_t i = 0; i < coeffs.size(); ++i) {
    coeffs[i].sr = true;
    coeffs[i].sr_key = sr_key(static_cast<uint64_t>(*seed), coeffs[i].step, slots[i]);
    coeffs[i].sr_index = starts[i];
  }
}

std::vector<Coeffs> step_coeffs(const char* fn, const char* like, size_t n,
                                const std::vector<at::Tensor>& state_steps,
                                const std::vector<at::Tensor>& steps_to_increment, double lr,
                                double beta1, double beta2, double eps, double weight_decay,
                                std::unordered_map<float*, float>& incremented) {
  if (state_steps.size() != n) {
    std::ostringstream msg;
    msg << fn << ": state_steps has " << state_steps.size() << " tensors: expected " << n
        << " like " << like;
    fail_value(msg.str());
  }
  for (size_t j = 0; j < steps_to_increment.size(); ++j) {
    check_step(fn, steps_to_increment[j], "steps_to_increment", j);
  }
  incremented.reserve(steps_to_increment.size());
  for (const at::Tensor& t : steps_to_increment) {
    float* ptr = t.mutable_data_ptr<float>();
    const auto it = incremented.try_emplace(ptr, *ptr).first;
    it->second += 1.0f;
  }
  std::vector<Coeffs> coeffs;
  coeffs.reserve(n);
  // The coefficients depend on the step value only (the hyper-parameters are the call's): reuse
  // the last ones while the value repeats, as it does for every tensor of a usual step (two pow
  // calls per tensor were a visible part of a call over thousands of small tensors).
  float last_value = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    check_step(fn, state_steps[i], "state_steps", i);
    const float* ptr = state_steps[i].const_data_ptr<float>();
    const auto found = incremented.find(const_cast<float*>(ptr));
    const float value = found == incremented.end() ? *ptr : found->second;
    if (!std::isfinite(value) || value < 1.0f) {
      std::ostringstream msg;
      msg << fn << ": state_steps[" << i << "] is " << value
          << " after the increments: expected a finite step >= 1";
      fail_value(msg.str());
    }
    if (!coeffs.empty() && value == last_value) {
      coeffs.push_back(coeffs.back());
    } else {
      coeffs.push_back(make_coeffs(value, lr, beta1, beta2, eps, weight_decay));
    }
    last_value = value;
  }
  return coeffs;
}

// A step per tensor, read from its fp32 step tensor as torch's fused AdamW reads it (see
// step_coeffs). The offload pipeline calls this once per chunk: the per-parameter step
// bookkeeping runs here, not as one Python-level tensor op per parameter.
void fused_mp_adamw_steps_(const std::vector<at::Tensor>& params_lowp,
                           const std::vector<at::Tensor>& grads_lowp,
                           const std::vector<at::Tensor>& masters,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<at::Tensor>& state_steps,
                           const std::vector<at::Tensor>& steps_to_increment, double lr,
                           double beta1, double beta2, double eps, double weight_decay,
                           std::optional<double> grad_scale, std::optional<double> grad_coef,
                           const std::vector<at::Tensor>& into,
                           const std::optional<at::Tensor>& checksums,
                           const std::vector<at::Tensor>& seen, const std::optional<int64_t>& sr_seed,
                           const std::vector<int64_t>& sr_slots, const std::vector<int64_t>& sr_starts) {
  const char* fn = "fused_mp_adamw_steps_";
  const auto [p_dtype, g_dtype] =
      check_lists(fn, params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs);
  check_seen(fn, seen, params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, p_dtype);
  Speculate spec = make_speculate(fn, grads_lowp, masters, exp_avgs, exp_avg_sqs, into, checksums);
  std::unordered_map<float*, float> incremented;
  std::vector<Coeffs> coeffs = step_coeffs(fn, "masters", masters.size(), state_steps,
                                           steps_to_increment, lr, beta1, beta2, eps,
                                           weight_decay, incremented);
  stochastic_rounding(fn, coeffs, sr_seed, sr_slots, sr_starts, moments_dtype(fn, exp_avgs));
  bump_versions(params_lowp, masters, exp_avgs, exp_avg_sqs, steps_to_increment, into.empty());
  for (const auto& [p, v] : incremented) *p = v;  // the first write
  update(params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, p_dtype, g_dtype, coeffs,
         make_xform(grad_scale, grad_coef), &spec, seen);
  finish_speculate(spec, into, checksums, masters.size());
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
void adamw_f32_steps_(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                      const std::vector<at::Tensor>& exp_avgs,
                      const std::vector<at::Tensor>& exp_avg_sqs,
                      const std::vector<at::Tensor>& state_steps,
                      const std::vector<at::Tensor>& outs,
                      const std::vector<at::Tensor>& steps_to_increment, double lr, double beta1,
                      double beta2, double eps, double weight_decay,
                      std::optional<double> grad_scale, std::optional<double> grad_coef,
                      const std::vector<at::Tensor>& into,
                      const std::optional<at::Tensor>& checksums, const std::optional<int64_t>& sr_seed,
                      const std::vector<int64_t>& sr_slots, const std::vector<int64_t>& sr_starts) {
  const char* fn = "adamw_f32_steps_";
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
  std::vector<Coeffs> coeffs = step_coeffs(fn, "params", n, state_steps, steps_to_increment, lr,
                                           beta1, beta2, eps, weight_decay, incremented);
  stochastic_rounding(fn, coeffs, sr_seed, sr_slots, sr_starts, m_dtype);
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
  const GradXform x = make_xform(grad_scale, grad_coef);
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

// Returns (terms float64[n], checksums int64[n]). `norm`: kNormL2, kNormL1 or kNormInf.
std::tuple<at::Tensor, at::Tensor> grad_stats_(const std::vector<at::Tensor>& tensors,
                                               int64_t norm) {
  const char* fn = "grad_stats";
  if (norm != kNormL2 && norm != kNormL1 && norm != kNormInf && norm != kNormNone) {
    fail_value(std::string(fn) + ": norm kind " + std::to_string(norm) +
               ": expected 0 (L2), 1 (L1), 2 (inf) or 3 (none: checksums only)");
  }
  const size_t n = tensors.size();
  std::vector<const void*> base(n);
  std::vector<at::ScalarType> dtype(n);
  std::vector<int64_t> numel(n), block_start(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[i];
    const auto where = [&]() { return std::string(fn) + ": tensors[" + std::to_string(i) + "]"; };
    if (!t.defined()) fail_value(where() + " is an undefined tensor");
    if (t.device().type() != c10::DeviceType::CPU) {
      fail_value(where() + " is on device " + t.device().str() + ": expected a CPU tensor");
    }
    if (t.layout() != c10::kStrided) fail_value(where() + ": expected a dense (strided) tensor");
    const at::ScalarType dt = t.scalar_type();
    if (dt != at::kFloat && dt != at::kBFloat16 && dt != at::kHalf) {
      fail_type(where() + " has dtype " + dtype_name(dt) +
                ": expected torch.float32, torch.bfloat16 or torch.float16");
    }
    if (!t.is_non_overlapping_and_dense()) {
      const auto tuple = [](c10::IntArrayRef v) {  // as Python prints a tuple
        std::ostringstream out;
        out << "(";
        for (size_t k = 0; k < v.size(); ++k) out << (k ? ", " : "") << v[k];
        out << (v.size() == 1 ? ",)" : ")");
        return out.str();
      };
      std::ostringstream msg;
      msg << where() << " (shape " << tuple(t.sizes()) << ", strides " << tuple(t.strides())
          << ") does not cover one dense block of memory: expected a contiguous tensor or a "
             "permutation of one";
      fail_value(msg.str());
    }
    if (t.is_conj() || t.is_neg()) fail_value(where() + " has a lazy conj/neg bit set");
    // A dense tensor with non-negative strides starts at its lowest address: its elements are
    // the numel() consecutive ones from there, whatever the order of its dimensions.
    base[i] = t.const_data_ptr();
    dtype[i] = dt;
    numel[i] = t.numel();
    block_start[i + 1] = block_start[i] + (numel[i] + kStatsBlock - 1) / kStatsBlock;
  }
  at::Tensor terms = at::zeros({static_cast<int64_t>(n)}, at::kDouble);
  at::Tensor sums = at::zeros({static_cast<int64_t>(n)}, at::kLong);
  const int64_t total = block_start[n];
  if (total == 0) return {terms, sums};
  std::vector<BlockStats> blocks(static_cast<size_t>(total));
  {
    pybind11::gil_scoped_release no_gil;
    const auto run_blocks = [&](int64_t begin, int64_t end) {
      size_t i = static_cast<size_t>(
          std::upper_bound(block_start.begin(), block_start.end(), begin) - block_start.begin() - 1);
      for (int64_t b = begin; b < end;) {
        while (block_start[i + 1] <= b) ++i;
        // Up to kStatsStreams blocks of tensor i, read side by side.
        const int count = static_cast<int>(
            std::min<int64_t>({kStatsStreams, end - b, block_start[i + 1] - b}));
        const int64_t lo = (b - block_start[i]) * kStatsBlock;
        const int64_t last_lo = lo + (count - 1) * kStatsBlock;
        const int64_t last_n = std::min(numel[i], last_lo + kStatsBlock) - last_lo;
        BlockStats* out = blocks.data() + b;
        if (norm == kNormL2) {
          blocks_side_by_side_of<kNormL2>(dtype[i], base[i], lo, count, last_n, out);
        } else if (norm == kNormL1) {
          blocks_side_by_side_of<kNormL1>(dtype[i], base[i], lo, count, last_n, out);
        } else if (norm == kNormInf) {
          blocks_side_by_side_of<kNormInf>(dtype[i], base[i], lo, count, last_n, out);
        } else {
          blocks_side_by_side_of<kNormNone>(dtype[i], base[i], lo, count, last_n, out);
        }
        b += count;
      }
    };
    int64_t elements = 0;
    for (size_t i = 0; i < n; ++i) elements += numel[i];
    const int64_t takes = (total + kStatsTake - 1) / kStatsTake;
    const int64_t workers = std::min<int64_t>(
        {static_cast<int64_t>(at::get_num_threads()), takes, elements / kStatsGrain + 1});
    if (workers <= 1 || at::in_parallel_region()) {
      run_blocks(0, total);
    } else {
      std::atomic<int64_t> next{0};
      at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
        for (int64_t k = next.fetch_add(1, std::memory_order_relaxed); k < takes;
             k = next.fetch_add(1, std::memory_order_relaxed)) {
          run_blocks(k * kStatsTake, std::min(total, (k + 1) * kStatsTake));
        }
      });
    }
  }
  double* tp = terms.mutable_data_ptr<double>();
  int64_t* sp = sums.mutable_data_ptr<int64_t>();
  for (size_t i = 0; i < n; ++i) {
    double term = 0.0;
    uint64_t sum = 0;
    for (int64_t b = block_start[i]; b < block_start[i + 1]; ++b) {
      const BlockStats& s = blocks[static_cast<size_t>(b)];
      if (norm == kNormInf) {
        if (!std::isnan(term) && (std::isnan(s.term) || s.term > term)) term = s.term;
      } else {
        term += s.term;
      }
      sum += s.sum;  // wraps modulo 2**64
    }
    tp[i] = term;
    sp[i] = static_cast<int64_t>(sum);
  }
  return {terms, sums};
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
  m.doc() = "Single-pass mixed-precision AdamW for CPU offload (see offload/kernels/_fused_mp.py).";
  m.def("fused_mp_adamw_", &fused_mp_adamw_, pybind11::arg("params_lowp"),
        pybind11::arg("grads_lowp"), pybind11::arg("masters"), pybind11::arg("exp_avgs"),
        pybind11::arg("exp_avg_sqs"), pybind11::kw_only(), pybind11::arg("step"),
        pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("beta2"),
        pybind11::arg("eps"), pybind11::arg("weight_decay"));
  m.def("fused_mp_adamw_steps_", &fused_mp_adamw_steps_, pybind11::arg("params_lowp"),
        pybind11::arg("grads_lowp"), pybind11::arg("masters"), pybind11::arg("exp_avgs"),
        pybind11::arg("exp_avg_sqs"), pybind11::arg("state_steps"), pybind11::kw_only(),
        pybind11::arg("steps_to_increment"), pybind11::arg("lr"), pybind11::arg("beta1"),
        pybind11::arg("beta2"), pybind11::arg("eps"), pybind11::arg("weight_decay"),
        pybind11::arg("grad_scale") = pybind11::none(),
        pybind11::arg("grad_coef") = pybind11::none(),
        pybind11::arg("into") = std::vector<at::Tensor>{},
        pybind11::arg("checksums") = pybind11::none(),
        pybind11::arg("seen") = std::vector<at::Tensor>{}, pybind11::arg("sr_seed") = pybind11::none(),
        pybind11::arg("sr_slots") = std::vector<int64_t>{}, pybind11::arg("sr_starts") = std::vector<int64_t>{});
  m.def("adamw_f32_steps_", &adamw_f32_steps_, pybind11::arg("params"), pybind11::arg("grads"),
        pybind11::arg("exp_avgs"), pybind11::arg("exp_avg_sqs"), pybind11::arg("state_steps"),
        pybind11::kw_only(), pybind11::arg("outs"), pybind11::arg("steps_to_increment"),
        pybind11::arg("lr"), pybind11::arg("beta1"), pybind11::arg("beta2"), pybind11::arg("eps"),
        pybind11::arg("weight_decay"), pybind11::arg("grad_scale") = pybind11::none(),
        pybind11::arg("grad_coef") = pybind11::none(),
        pybind11::arg("into") = std::vector<at::Tensor>{},
        pybind11::arg("checksums") = pybind11::none(), pybind11::arg("sr_seed") = pybind11::none(),
        pybind11::arg("sr_slots") = std::vector<int64_t>{}, pybind11::arg("sr_starts") = std::vector<int64_t>{});
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
