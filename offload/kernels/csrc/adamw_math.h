// The AdamW arithmetic of one element or one vector of elements, shared by both steps
// (mp_adamw.h, adamw_f32.h): the coefficients, the gradient transforms, the lane update and the
// scalar tail. Its reference is torch's fused CPU AdamW (offload/kernels/_adamw.py: fused_adamw_).
//
// Bitwise agreement with torch's fused CPU AdamW (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
// float tensors, ADAMW mode, no amsgrad/maximize/grad scaling):
// - the scalar coefficients are computed in double and cast to float exactly as torch does;
// - every tensor is split into the same vectorised body (numel rounded down to a multiple of
//   Vectorized<float>::size()) and scalar tail as torch splits it;
// - the extension is compiled with -ffp-contract=off, and every fused multiply-add is written out.
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

#pragma once

#include "common.h"
#include "rounding.h"
#include "vec_io.h"

namespace {

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

#if OFFLOAD_VECTOR_BUILD
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

}  // namespace
