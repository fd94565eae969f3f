// Stochastic rounding of bf16 moments (state_rounding="stochastic"); offload/kernels/_rounding.py is
// the same function in torch ops, bit for bit.

#pragma once

#include "common.h"

namespace {

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

}  // namespace
