"""Tune only the thread count of a stock optimizer's CPU ``step()``: ``tune_step_threads``.

Who needs it: users who already run the optimizer step on the CPU with an optimizer this project
did not write: FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer states on
the CPU, torch's ``AdamW`` stepping there; torchtitan's ``--training.enable_cpu_offload``), or any
CPU model. Under torchrun that step runs with ``OMP_NUM_THREADS=1``. The wrapper gives it the
measured, agreed and cached thread count of ``CPUOffloadAdamW`` without switching optimizers.

What the wrapper is. :class:`ThreadTunedOptimizer` is a ``torch.optim.Optimizer`` that *delegates*
to the wrapped one rather than copying or sharing its ``__dict__``:

* the data attributes (``param_groups``, ``state``, ``defaults`` and the six hook dictionaries of
  ``torch.optim.Optimizer``) are descriptors that read and write the wrapped optimizer's
  attributes, so both objects always see the same data, whoever replaces it
  (``load_state_dict`` re-binds ``state`` and ``param_groups``);
* the public methods (``state_dict``, ``load_state_dict``, ``zero_grad``, ``add_param_group``,
  the ``register_*_hook`` family) call the wrapped optimizer's own methods, so a subclass's
  overrides run and hooks are registered once, where its ``step`` runs them;
* anything else (``_step_supports_amp_scaling``, a custom attribute) is read from the wrapped
  optimizer by ``__getattr__``; attributes *set* on the wrapper stay on the wrapper, except
  ``grad_scale`` and ``found_inf``, which ``torch.amp.GradScaler.step`` sets on the optimizer it is
  given for the wrapped (fused) step to read: they are descriptors too, or the wrapped step would
  silently skip unscaling.

Why not share ``__dict__`` (``wrapper.__dict__ = optimizer.__dict__``, which gives every
attribute for free): LR schedulers patch ``step`` by assigning an instance attribute
``opt.step``. With a shared ``__dict__`` that attribute lands on the wrapped optimizer too, so a
scheduler made before wrapping would shadow the tuned ``step`` (the wrapper would silently run
untuned) and one made after would make the original's ``step`` run the wrapper's. With
delegation each object keeps its own ``step``, and the wrapper's ``step`` is the one schedulers,
``GradScaler`` and ``torch.distributed.checkpoint`` (whose ``_init_optim_state`` calls
``step(closure=None)``) call.

The step. ``step()`` runs the wrapped step inside :func:`offload.thread_limit`: torch's intra-op
thread count is the tuned value for the step only and restored afterwards, so forward and backward
keep theirs. The online tuner (``autotune.OnlineTuner``) sees one sample per step: the step's wall
time; the node's time is the max over local ranks, as for ``CPUOffloadAdamW``. The knob is
``threads``: a geometric ladder from 1 (the launcher default) to the largest thread budget of any
local rank (:func:`offload.plan_cpu_threads`), capped per rank at its own plan; the static plan is
the baseline. The thread plan and the tuner share one node agreement (``offload.tuning._node_agreement``).
Cache (fingerprint workload: the optimizer's class and implementation flags, the parameters'
count, element count and dtypes), trace files and ``python -m autotune`` are the tuner's,
unchanged.

Numerics. Only the number of threads changes, never the math, *if* torch's CPU kernels give the
same bits for every thread count. On torch 2.13 (CPU build, this project's CI) they do for every
optimizer listed in :data:`THREAD_INVARIANT_OPTIMIZERS`, including ``AdamW(fused=True)`` and
``AdamW(foreach=True)`` on FSDP2 ``CPUOffloadPolicy`` shards; ``tests/test_stock.py`` re-checks
each of them at 1-4 threads on tensors whose sizes leave vector tails, and at 1 and 2 threads
on language-model shapes (more than 65536 rows), so a torch build that breaks this fails there,
naming the optimizer. What is *not* invariant on the same build: a reduction over many elements,
such as ``tensor.sum()`` over 16M elements or a mean over a dimension of 32768 or more, differs in
its last bits between 1 and 2-4 threads (measured 2026-12-01 on the 2-core VM). Every optimizer
listed is elementwise. Adafactor is not: it averages its factored second moment over the rows, so
torch's and transformers' Adafactor on a 50257-row embedding differ by up to 5e-7 between 1 and 2
threads; the wrapper refuses the optimizers of :data:`REDUCING_OPTIMIZERS` (it found 333-row
weights invariant and listed Adafactor until it met an embedding). A custom optimizer that reduces
across elements may give different bits at different thread counts, wrapped or not: check it with
the same tests before relying on bitwise reproducibility.

What it refuses (:class:`StepThreadsError`, ``TypeError`` for a wrong type): parameters that are
not on the CPU (their step runs on the accelerator, where CPU threads do not matter), parameters
on mixed devices, an object that is not a ``torch.optim.Optimizer``, ``CPUOffloadAdamW`` (it tunes
its own threads), a second wrapping, ``LBFGS``, whose step evaluates its closure many times, and
Adafactor (above).
``step(closure)`` (Lightning's automatic optimization always passes one) works where ``step`` is
torch's own (AdamW, Adam, SGD, ...: they evaluate the closure once, first, under
``torch.enable_grad()``): the wrapper evaluates it the same way under the caller's thread count
(it runs forward and backward, whose time is not the optimizer's), then runs the step under the
tuned count with ``closure=None``, and returns the closure's value. Another class's ``step``
might evaluate its closure later or twice (SAM): ``step(closure)`` raises there.
"""

from __future__ import annotations

import collections
import inspect
import logging
import time
from typing import Any, Callable, Iterable

import torch

from autotune import AutotuneConfig, OnlineTuner, StepSample, TraceWriter, cache_for, trace_for
from offload._settings import omp_wait_policy
from offload.tuning._glue import step_threads_space
from offload.tuning._node_agreement import NodeAgreement, node_agreement, thread_plan, tuning_config
from offload.threads._plan import ThreadPlan, thread_limit

logger = logging.getLogger(__name__)

__all__ = [
    "REDUCING_OPTIMIZERS",
    "THREAD_INVARIANT_OPTIMIZERS",
    "StepThreadsError",
    "ThreadTunedOptimizer",
    "step_threads_space",
    "step_threads_workload",
    "tune_step_threads",
]

#: torch CPU optimizers (and implementation flags) whose results tests/test_stock.py checks to be
#: bitwise identical at 1, 2, 3 and 4 intra-op threads, and at 1 and 2 on 65536-row weights
#: (torch 2.13 CPU: all of them are). All are elementwise.
THREAD_INVARIANT_OPTIMIZERS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("AdamW", {"fused": True}),
    ("AdamW", {"foreach": True}),
    ("AdamW", {"foreach": False}),
    ("AdamW", {"fused": True, "amsgrad": True}),
    ("Adam", {"fused": True}),
    ("SGD", {"momentum": 0.9}),
    ("SGD", {"momentum": 0.9, "foreach": True}),
    ("SGD", {"momentum": 0.9, "fused": True}),
    ("Adagrad", {"fused": True}),
    ("RMSprop", {"momentum": 0.9, "foreach": True}),
    ("NAdam", {"foreach": True}),
    ("RAdam", {"foreach": True}),
    ("Adamax", {"foreach": True}),
    ("Adadelta", {"foreach": True}),
    ("ASGD", {"foreach": True}),
    ("Rprop", {"foreach": True}),
)

#: Class names (matched along the optimizer's MRO: torch.optim.Adafactor, transformers' and timm's
#: Adafactor) of optimizers whose step reduces across elements, so its bits depend on the thread
#: count; tune_step_threads refuses them, giving the reason.
REDUCING_OPTIMIZERS: dict[str, str] = {
    "Adafactor": "its step averages the factored second moment over the rows (and takes norms), a "
                 "reduction whose last bits depend on the thread count (5e-7 apart at 1 vs 2 threads "
                 "on a 50257-row embedding)",
}

_CLOSURE_HINT = (
    "a closure runs forward and backward inside step(), so its wall time is not the optimizer's and "
    "the step's thread count would also apply to forward/backward; call the closure yourself "
    "(loss = closure()), then opt.step()"
)


def evaluates_closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer.step(closure)`` is torch's own (not LBFGS's): it evaluates the closure once,
    before updating, so evaluating it first and then calling ``step()`` is the same."""
    module = getattr(type(optimizer).step, "__module__", "") or ""
    return module.startswith("torch.optim.") and not isinstance(optimizer, torch.optim.LBFGS)


class StepThreadsError(ValueError):
    """An optimizer or a call whose CPU step this wrapper cannot tune (the message says why)."""


# --------------------------------------------------------------------------- inputs


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def check_cpu_params(params: Iterable[torch.Tensor], what: str = "tune_step_threads") -> None:
    """Raise :class:`StepThreadsError` unless every parameter is on the CPU (DTensor: its shard)."""
    devices = collections.Counter(str(p.device) for p in params)
    if len(devices) > 1:
        listed = ", ".join(f"{d} ({n} tensor{'s' if n > 1 else ''})" for d, n in sorted(devices.items()))
        raise StepThreadsError(
            f"{what}: the optimizer's parameters are on mixed devices: {listed}; expected all on the CPU "
            "(only a step that runs on the CPU has a CPU thread count to tune)"
        )
    device = next(iter(devices), "cpu")
    if device != "cpu":
        raise StepThreadsError(
            f"{what}: the optimizer's parameters are on {device}, not on the CPU: their step would run on "
            f"{device}, where CPU threads do not matter; wrap an optimizer of CPU parameters (FSDP2 "
            "CPUOffloadPolicy shards, a CPU model), or use offload.CPUOffloadAdamW to offload the step"
        )


def step_threads_workload(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The fingerprint workload of a wrapped optimizer (the same on every rank of an FSDP2 job:
    parameter counts are global, a DTensor counting its full shape)."""
    params = _params(optimizer)
    cls = type(optimizer)
    flags = {k: v for k, v in sorted(optimizer.defaults.items()) if v is None or isinstance(v, bool)}
    sharded = False
    try:
        from torch.distributed.tensor import DTensor

        sharded = any(isinstance(p, DTensor) for p in params)
    except ImportError:  # pragma: no cover - torch without distributed
        pass
    return {
        "optimizer": f"{cls.__module__}.{cls.__qualname__}",
        "options": flags,
        "tensors": len(params),
        "params": sum(int(p.numel()) for p in params),
        "groups": len(optimizer.param_groups),
        "dtypes": sorted({str(p.dtype) for p in params}),
        "sharded": sharded,
        "device": "cpu",
        "objective": "stock-step",
    }


# --------------------------------------------------------------------------- the wrapper


class _Delegated:
    """A data attribute of ``torch.optim.Optimizer`` read and written on the wrapped optimizer."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj._stock_inner, self.name)

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj._stock_inner, self.name, value)

    def __delete__(self, obj: Any) -> None:
        delattr(obj._stock_inner, self.name)


def _delegate(name: str) -> Callable[..., Any]:
    def method(self: ThreadTunedOptimizer, *args: Any, **kwargs: Any) -> Any:
        return getattr(self._stock_inner, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"The wrapped optimizer's ``{name}``."
    return method


class ThreadTunedOptimizer(torch.optim.Optimizer):
    """A stock optimizer whose ``step()`` runs under a tuned, step-scoped CPU thread count.

    Made by :func:`tune_step_threads`; see the module doc for what it delegates and why.
    ``wrapped`` is the wrapped optimizer, ``tuner`` the ``OnlineTuner`` (or None), ``threads`` the
    thread count of the next step, ``last_step_s`` the wall time of the last one.
    """

    param_groups = _Delegated()  # type: ignore[assignment]
    state = _Delegated()  # type: ignore[assignment]
    defaults = _Delegated()  # type: ignore[assignment]
    _optimizer_step_pre_hooks = _Delegated()  # type: ignore[assignment]
    _optimizer_step_post_hooks = _Delegated()  # type: ignore[assignment]
    _optimizer_state_dict_pre_hooks = _Delegated()  # type: ignore[assignment]
    _optimizer_state_dict_post_hooks = _Delegated()  # type: ignore[assignment]
    _optimizer_load_state_dict_pre_hooks = _Delegated()  # type: ignore[assignment]
    _optimizer_load_state_dict_post_hooks = _Delegated()  # type: ignore[assignment]
    # GradScaler.step sets these two on the optimizer it is given and the wrapped step reads them
    # from itself (fused kernels unscale with them): they must land there.
    grad_scale = _Delegated()
    found_inf = _Delegated()

    state_dict = _delegate("state_dict")  # type: ignore[assignment]
    load_state_dict = _delegate("load_state_dict")  # type: ignore[assignment]
    zero_grad = _delegate("zero_grad")  # type: ignore[assignment]
    register_step_pre_hook = _delegate("register_step_pre_hook")  # type: ignore[assignment]
    register_step_post_hook = _delegate("register_step_post_hook")  # type: ignore[assignment]
    register_state_dict_pre_hook = _delegate("register_state_dict_pre_hook")  # type: ignore[assignment]
    register_state_dict_post_hook = _delegate("register_state_dict_post_hook")  # type: ignore[assignment]
    register_load_state_dict_pre_hook = _delegate("register_load_state_dict_pre_hook")  # type: ignore[assignment]
    register_load_state_dict_post_hook = _delegate("register_load_state_dict_post_hook")  # type: ignore[assignment]

    def __init__(self, optimizer: torch.optim.Optimizer, *, plan: ThreadPlan, autotune: AutotuneConfig | None,
                 clock: Callable[[], float] = time.perf_counter, agreement: NodeAgreement | None = None) -> None:
        # torch.optim.Optimizer.__init__ is not called on purpose: every attribute it would set is
        # the wrapped optimizer's (the descriptors above), and it would hook this class's step,
        # running the step hooks twice (the wrapped step runs them).
        self._stock_inner = optimizer
        self._clock = clock
        self._own_threads = plan.threads
        self._threads = plan.threads
        self.last_step_s: float | None = None
        self.tuner: OnlineTuner | None = None
        self._spin_checked = False
        self._trace: TraceWriter | None = None
        self._agreement: NodeAgreement | None = None
        if autotune is not None:
            if agreement is None:
                agreement = node_agreement(timeout_s=autotune.timeout_s, owner="tune_step_threads")
            self._agreement = agreement
            self._start_tuner(optimizer, plan, autotune, agreement)

    def _start_tuner(self, optimizer: torch.optim.Optimizer, plan: ThreadPlan, config: AutotuneConfig,
                     agreement: NodeAgreement) -> None:
        fixed = plan.source != "plan"
        # As OffloadTuning: the ladder tops at the largest budget of any local rank (the same space
        # on every rank) and each rank caps the knob at its own plan (_apply).
        local = tuple(plan.local_threads) or (plan.threads,)
        top = plan.threads if fixed else max(local)
        space = step_threads_space(max_threads=top, baseline_threads=top, fixed_threads=fixed)
        self._trace = trace_for(config)
        self.tuner = OnlineTuner(space, baseline={"threads": top}, apply=self._apply, config=config,
                                 workload=step_threads_workload(optimizer), cache=cache_for(config), trace=self._trace,
                                 group=agreement)
        self.tuner.start()

    def _apply(self, setting: dict[str, Any]) -> None:
        self._threads = min(int(setting["threads"]), self._own_threads)

    # ---------------------------------------------------------------- what differs: step

    @property
    def wrapped(self) -> torch.optim.Optimizer:
        """The wrapped optimizer."""
        return self._stock_inner

    @property
    def threads(self) -> int:
        """Intra-op threads of the next ``step()`` (the tuner's current choice, capped at this rank's plan)."""
        return self._threads

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """The wrapped optimizer's ``step()`` with ``threads`` intra-op threads; the thread count
        of the caller is restored afterwards. A ``closure`` is evaluated first, under the caller's
        threads and ``torch.enable_grad()``, and its value returned (torch's optimizers only;
        see the module doc)."""
        loss = None
        if closure is not None:
            if not evaluates_closure_first(self._stock_inner):
                raise StepThreadsError(f"{type(self._stock_inner).__name__}.step(closure) cannot be "
                                       f"tuned (its step is not torch's): {_CLOSURE_HINT}")
            with torch.enable_grad():
                loss = closure()
        with thread_limit(self._threads):
            began = self._clock()
            out = self._stock_inner.step(**kwargs)
            step_s = self._clock() - began
        self.last_step_s = step_s
        if self.tuner is not None:
            self.tuner.observe(StepSample(time_s=step_s, stages={"step_s": step_s}))  # writes the summary at lock-in
            if not self._spin_checked and self.tuner.state == "locked":
                self._spin_checked = True
                notice = spin_wait_notice(self.tuner.summary())
                if notice is not None and self.tuner.rank == 0:
                    logger.warning("%s", notice)
        return loss if closure is not None else out

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's ``add_param_group``, after checking the new parameters are on the CPU."""
        params = param_group.get("params", ())
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        check_cpu_params([*_params(self._stock_inner), *params], "add_param_group")
        self._stock_inner.add_param_group(param_group)

    def close(self) -> None:
        """Write the trace summary and release the tuner's gloo group (idempotent)."""
        if self._trace is not None and self.tuner is not None:
            self._trace.write_summary(self.tuner.summary())
            self._trace.close()
            self._trace = None
        if self.tuner is not None:
            self.tuner.close()
        if self._agreement is not None:
            self._agreement.close()

    # ---------------------------------------------------------------- plumbing

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: the wrapped optimizer's other attributes.
        inner = self.__dict__.get("_stock_inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __getstate__(self) -> dict[str, Any]:
        # copy.copy, copy.deepcopy, pickle and torch.save all come here (object.__reduce_ex__).
        raise TypeError(
            "ThreadTunedOptimizer cannot be copied, pickled or saved whole (it holds a tuner and its "
            "process group): checkpoint opt.state_dict() and load_state_dict() it into a new "
            "tune_step_threads(...) of a new optimizer, or copy opt.wrapped"
        )

    def __repr__(self) -> str:
        state = self.tuner.state if self.tuner is not None else "off"
        return f"ThreadTunedOptimizer(threads={self._threads}, tuner={state}, wrapped={self._stock_inner!r})"


#: More threads this many times slower than 1 thread on the mean, in the tuner's measurements:
#: the signature of OpenMP threads that spin-wait beside other work on the same cores.
SPIN_WAIT_SLOWDOWN = 2.0


def spin_wait_notice(summary: dict[str, Any]) -> str | None:
    """What ``tune_step_threads`` logs (once, rank 0, at lock-in) when its measurements show more
    threads at least :data:`SPIN_WAIT_SLOWDOWN` times slower than 1 thread and ``OMP_WAIT_POLICY``
    is not ``PASSIVE``: the cause, and the launcher setting that removes it (docs/environment.md,
    measured in bench/results/README.md). None otherwise."""
    if (omp_wait_policy() or "").strip().upper() == "PASSIVE":
        return None
    samples: dict[int, list[float]] = collections.defaultdict(list)
    for m in summary["measurements"]:  # {"candidate": {"threads": n}, "samples": [...], ...}
        samples[int(m["candidate"]["threads"])].extend(m["samples"])
    mean = {t: sum(xs) / len(xs) for t, xs in samples.items() if xs}
    if 1 not in mean or mean[1] <= 0:
        return None
    slowest = max((t for t in mean if t > 1), key=mean.__getitem__, default=None)
    if slowest is None or mean[slowest] < SPIN_WAIT_SLOWDOWN * mean[1]:
        return None
    return (f"tune_step_threads: {slowest} threads ran {mean[slowest] / mean[1]:.1f}x slower than 1 thread "
            f"here (mean {1e3 * mean[slowest]:.3g} ms against {1e3 * mean[1]:.3g} ms a step): OpenMP threads that "
            "spin-wait beside other processes on these cores do that; launched with OMP_WAIT_POLICY=PASSIVE, "
            "more threads can pay (docs/environment.md)")


def tune_step_threads(
    optimizer: torch.optim.Optimizer,
    *,
    autotune: AutotuneConfig | bool = True,
    threads: int | None = None,
    plan: ThreadPlan | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> ThreadTunedOptimizer:
    """Wrap ``optimizer`` (a ``torch.optim.Optimizer`` of CPU parameters) so its ``step()`` runs
    under a step-scoped intra-op thread count chosen online by ``autotune.OnlineTuner``.

    Use the returned object everywhere in place of ``optimizer`` (LR schedulers, checkpointing);
    both see the same ``param_groups`` and ``state``. Under torch.distributed every rank of the
    node must call this together (the thread plan and the tuner start with collectives).

    Args:
        optimizer: the optimizer to wrap.
        autotune: ``True`` (default ``AutotuneConfig()``) or an ``AutotuneConfig``: tune the thread
            count; ``False``: run every step with the thread plan's count, untuned.
        threads: a fixed thread count (then nothing is tuned); default: ``plan_cpu_threads()``
            (which honours ``OFFLOAD_AUTOTUNE_THREADS``).
        plan: the thread plan to use instead of ``plan_cpu_threads(threads=threads)`` (tests,
            simulations; with ``threads``, an error).
        clock: the clock that times each step (tests inject one).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, or a bad ``autotune``.
        StepThreadsError: parameters not on the CPU or on mixed devices, an optimizer that tunes
            its own threads or is already wrapped, one whose step needs a closure, or one whose step
            reduces across elements (:data:`REDUCING_OPTIMIZERS`: Adafactor).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"tune_step_threads: optimizer={optimizer!r} ({type(optimizer).__name__}): expected a "
            "torch.optim.Optimizer"
        )
    if isinstance(optimizer, ThreadTunedOptimizer):
        raise StepThreadsError("tune_step_threads: this optimizer is already wrapped by tune_step_threads")
    if getattr(type(optimizer), "tunes_own_threads", False):  # CPUOffloadAdamW (not imported: a layer below it)
        raise StepThreadsError(
            "tune_step_threads: CPUOffloadAdamW tunes its own threads (and chunk size): pass "
            "autotune=AutotuneConfig(...) to it instead of wrapping it"
        )
    closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise StepThreadsError(
            f"tune_step_threads: {type(optimizer).__name__}.step requires a closure, which cannot be "
            f"timed fairly: {_CLOSURE_HINT}"
        )
    reducing = next((c for c in type(optimizer).__mro__ if c.__name__ in REDUCING_OPTIMIZERS), None)
    if reducing is not None:
        raise StepThreadsError(
            f"tune_step_threads: {type(optimizer).__module__}.{type(optimizer).__qualname__} is not thread-count "
            f"invariant: {REDUCING_OPTIMIZERS[reducing.__name__]}, so a tuned step would not be bitwise the "
            "untuned one; step it unwrapped (under a thread count you fix, torch.set_num_threads), or tune an "
            "elementwise optimizer (AdamW, SGD, ...: offload._stock.THREAD_INVARIANT_OPTIMIZERS)"
        )
    config = tuning_config(autotune, threads=threads, plan=plan, owner="tune_step_threads", error=StepThreadsError)
    check_cpu_params(_params(optimizer))
    # The thread plan and the tuner share the node's one agreement (offload.tuning._node_agreement).
    plan, agreement = thread_plan(config, threads=threads, plan=plan, owner="tune_step_threads")
    wrapper = ThreadTunedOptimizer(optimizer, plan=plan, autotune=config, clock=clock,
                                   agreement=agreement)
    logger.info(
        "tune_step_threads: %s, %d tensors: step with %d thread(s) now (tuner %s; plan %d: %s)",
        type(optimizer).__name__, len(_params(optimizer)), wrapper.threads,
        wrapper.tuner.state if wrapper.tuner is not None else "off", plan.threads, plan.reason,
    )
    return wrapper
