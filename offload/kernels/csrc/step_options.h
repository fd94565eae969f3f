// What both AdamW entry points (mp_adamw.h, adamw_f32.h) do before their first write: read the
// call's options (StepOptions: everything but the tensors, one record built in
// offload/kernels/_fused_mp.py), torch's step bookkeeping (each tensor's fp32 step tensor,
// incremented as torch._foreach_add_ does before the fused call; offload/kernels/_adamw.py:
// fused_adamw_ is the torch form), the moments' dtype, stochastic rounding's keys and the version
// counters.

#pragma once

#include "adamw_math.h"
#include "common.h"
#include "rounding.h"

namespace {

// Everything of one AdamW call that is not a tensor: the param group's hyper-parameters, the
// gradient transforms and stochastic rounding. Read once, before any check of the tensors, from
// the Python record (offload.kernels._fused_mp.StepOptions, a frozen dataclass of these fields;
// `rounding` there is (sr_seed, sr_slots, sr_starts) or None).
struct StepOptions {
  double lr = 0.0;
  double beta1 = 0.0;
  double beta2 = 0.0;
  double eps = 0.0;
  double weight_decay = 0.0;
  std::optional<double> grad_scale;  // each gradient element is used as g / grad_scale
  std::optional<double> grad_coef;   // then * grad_coef, rounded to the gradient's dtype
  // Stochastic rounding of bf16 moments (see stochastic_rounding): off, or the seed and, per
  // tensor, its parameter's slot and the index in it of its first element.
  std::optional<int64_t> sr_seed;
  std::vector<int64_t> sr_slots;
  std::vector<int64_t> sr_starts;
};

// One field of the Python record, as T; TypeError naming the field when it is missing or of
// another type.
template <typename T>
T read_field(const char* fn, pybind11::handle options, const char* name, const char* expected) {
  if (!pybind11::hasattr(options, name)) {
    fail_type(std::string(fn) + ": options has no field " + name +
              ": expected an offload.kernels._fused_mp.StepOptions");
  }
  const pybind11::object value = options.attr(name);
  try {
    return value.cast<T>();
  } catch (const pybind11::cast_error&) {
    fail_type(std::string(fn) + ": options." + name + " is " + std::string(pybind11::repr(value)) +
              ": expected " + expected);
  }
}

// The record's fields (the GIL is held: this runs before the update releases it).
StepOptions read_options(const char* fn, pybind11::handle options) {
  StepOptions o;
  o.lr = read_field<double>(fn, options, "lr", "a float");
  o.beta1 = read_field<double>(fn, options, "beta1", "a float");
  o.beta2 = read_field<double>(fn, options, "beta2", "a float");
  o.eps = read_field<double>(fn, options, "eps", "a float");
  o.weight_decay = read_field<double>(fn, options, "weight_decay", "a float");
  o.grad_scale = read_field<std::optional<double>>(fn, options, "grad_scale", "a float or None");
  o.grad_coef = read_field<std::optional<double>>(fn, options, "grad_coef", "a float or None");
  using Rounding = std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>>;
  const auto rounding = read_field<std::optional<Rounding>>(
      fn, options, "rounding", "None or (seed, slots, starts): an int and two lists of ints");
  if (rounding.has_value()) {
    o.sr_seed = std::get<0>(*rounding);
    o.sr_slots = std::get<1>(*rounding);
    o.sr_starts = std::get<2>(*rounding);
  }
  return o;
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

// After every check: bumps the version counters of the tensors written (in-place semantics for
// autograd, as torch's own in-place ops). Raises, still before any write, for inference tensors
// outside InferenceMode.
// `in_place`: the state tensors are written (no `into`); out of place they are only read, and
// keep their versions (an own master, the parameter itself, must not look edited).
void bump_versions(const std::vector<at::Tensor>& params_lowp,
                   const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& exp_avgs,
                   const std::vector<at::Tensor>& exp_avg_sqs,
                   const std::vector<at::Tensor>& steps, bool in_place) {
  for (size_t i = 0; i < masters.size(); ++i) {
    params_lowp[i].unsafeGetTensorImpl()->bump_version();
    if (!in_place) continue;
    for (const at::Tensor* t : {&masters[i], &exp_avgs[i], &exp_avg_sqs[i]}) {
      t->unsafeGetTensorImpl()->bump_version();
    }
  }
  for (const at::Tensor& t : steps) t.unsafeGetTensorImpl()->bump_version();
}

// Checks a 0-d (or one-element) fp32 CPU step tensor.
void check_step(const char* fn, const at::Tensor& t, const char* arg, size_t i) {
  check_cpu(fn, t, arg, i);
  const auto where = [&]() { return where_of(fn, arg, i); };
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

// state_rounding="stochastic" (see sr_key): per tensor its parameter's slot and the index of its
// first element in that parameter (StepOptions' sr_*); the moments must be bf16. Checked before
// any write.
void stochastic_rounding(const char* fn, std::vector<Coeffs>& coeffs, const StepOptions& options,
                         at::ScalarType m_dtype) {
  const std::optional<int64_t>& seed = options.sr_seed;
  const std::vector<int64_t>& slots = options.sr_slots;
  const std::vector<int64_t>& starts = options.sr_starts;
  if (!seed.has_value()) return;
  if (m_dtype != at::kBFloat16 && !coeffs.empty()) {
    fail_value(std::string(fn) + ": options.rounding (stochastic rounding) with moments of dtype " + dtype_name(m_dtype) +
               ": expected torch.bfloat16 moments");
  }
  if (slots.size() != coeffs.size() || starts.size() != coeffs.size()) {
    std::ostringstream msg;
    msg << fn << ": options.rounding has " << slots.size() << " slots and " << starts.size()
        << " starts: expected " << coeffs.size() << " of each (one per tensor)";
    fail_value(msg.str());
  }
  for (size_t i = 0; i < coeffs.size(); ++i) {
    coeffs[i].sr = true;
    coeffs[i].sr_key = sr_key(static_cast<uint64_t>(*seed), coeffs[i].step, slots[i]);
    coeffs[i].sr_index = starts[i];
  }
}

// The steps of one call: checks every step tensor and computes each tensor's coefficients from
// the value its step tensor holds after adding one to each of `steps_to_increment` (as
// torch._foreach_add_(steps, 1) does before the fused call). Writes nothing: the increments are
// returned in `incremented` (by address), for the caller to store once every check passed. A
// storage listed twice (the same tensor, or two views of one element) goes up twice, as with
// _foreach_add_. mutable_data_ptr materialises a copy-on-write storage (values unchanged), so a
// lazily cloned step tensor never shares the address its original is incremented at.
std::vector<Coeffs> step_coeffs(const char* fn, const char* like, size_t n,
                                const std::vector<at::Tensor>& state_steps,
                                const std::vector<at::Tensor>& steps_to_increment,
                                const StepOptions& o, std::unordered_map<float*, float>& incremented) {
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
      coeffs.push_back(make_coeffs(value, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay));
    }
    last_value = value;
  }
  return coeffs;
}

}  // namespace
