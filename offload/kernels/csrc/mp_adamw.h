// The mixed-precision AdamW step (bf16/fp16 parameter, fp32 master): fused_mp_adamw_steps_.
// offload/kernels/_mp_reference.py is its reference in torch ops (upcast, torch's fused AdamW,
// downcast); offload/kernels/_follow.py the torch-ops form of its `seen` check.
//
// One pass per element: read the low-precision (bf16/fp16) gradient, upcast it exactly to fp32,
// update the fp32 master weight and both fp32 moments in place, and write the master, rounded to
// nearest-even, into the low-precision parameter. Traffic: 2 (grad) + 8 (master r/w) + 8 (exp_avg
// r/w) + 8 (exp_avg_sq r/w) + 2 (param write) = 28 bytes per parameter (large calls write the
// parameter with non-temporal stores, so no read-for-ownership adds 2 more).

#pragma once

#include "adamw_math.h"
#include "common.h"
#include "outputs.h"
#include "step_options.h"
#include "vec_io.h"

namespace {

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

// One call's update of every tensor (their dtypes as template arguments), in one parallel region
// (for_each_span), each span in place or out of place and checksummed as `spec` says.
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
            const GradXform& x, const Speculate* spec, const std::vector<at::Tensor>& seen) {
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

// The mixed-precision step: a step per tensor, read from its fp32 step tensor as torch's fused
// AdamW reads it (see step_coeffs). The offload pipeline calls this once per chunk: the
// per-parameter step bookkeeping runs here, not as one Python-level tensor op per parameter.
// The tensors, then `options` (StepOptions: hyper-parameters, gradient transforms, rounding).
void fused_mp_adamw_steps_(const std::vector<at::Tensor>& params_lowp,
                           const std::vector<at::Tensor>& grads_lowp,
                           const std::vector<at::Tensor>& masters,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<at::Tensor>& state_steps,
                           const std::vector<at::Tensor>& steps_to_increment,
                           const std::vector<at::Tensor>& into,
                           const std::optional<at::Tensor>& checksums,
                           const std::vector<at::Tensor>& seen, pybind11::handle options) {
  const char* fn = "fused_mp_adamw_steps_";
  const StepOptions o = read_options(fn, options);
  const auto [p_dtype, g_dtype] =
      check_lists(fn, params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs);
  check_seen(fn, seen, params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, p_dtype);
  Speculate spec = make_speculate(fn, grads_lowp, masters, exp_avgs, exp_avg_sqs, into, checksums);
  std::unordered_map<float*, float> incremented;
  std::vector<Coeffs> coeffs = step_coeffs(fn, "masters", masters.size(), state_steps,
                                           steps_to_increment, o, incremented);
  stochastic_rounding(fn, coeffs, o, moments_dtype(fn, exp_avgs));
  bump_versions(params_lowp, masters, exp_avgs, exp_avg_sqs, steps_to_increment, into.empty());
  for (const auto& [p, v] : incremented) *p = v;  // the first write
  update(params_lowp, grads_lowp, masters, exp_avgs, exp_avg_sqs, p_dtype, g_dtype, coeffs,
         make_xform(o.grad_scale, o.grad_coef), &spec, seen);
  finish_speculate(spec, into, checksums, masters.size());
}

}  // namespace
