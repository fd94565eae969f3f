// grad_stats_: per-tensor norm terms and content checksums in one read (offload/kernels/_grad_stats.py
// is its reference in torch ops: grad_stats_reference, checksums_reference).

#pragma once

#include "common.h"
#include "rounding.h"

namespace {

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
// (splitmix64: rounding.h, with stochastic rounding's keys.)
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
    check_cpu(fn, t, "tensors", i);
    const auto where = [&]() { return where_of(fn, "tensors", i); };
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

}  // namespace
