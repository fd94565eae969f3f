"""Tune the thread count of DeepSpeed ZeRO-Offload's CPU Adam step: ``tune_deepspeed(engine)``.

Who needs it: a ``deepspeed.initialize`` engine with ZeRO stage 1 or 2 and
``offload_optimizer: {device: cpu}``. Its ``DeepSpeedZeroOptimizer`` keeps fp32 master partitions
on the host and steps them with ``DeepSpeedCPUAdam``, whose cores are otherwise set by hand
(``--bind_cores_to_rank``, ``OMP_NUM_THREADS``; torchrun sets 1 per rank).

Which setting DeepSpeedCPUAdam reads, measured (DeepSpeed 0.19.8, torch 2.13 CPU, 2-core VM,
2026-12-05): its kernel is an ``#pragma omp parallel for`` of the OpenMP runtime its JIT-built
``cpu_adam.so`` binds. DeepSpeed compiles it with ``-fopenmp`` but links no OpenMP library
(``readelf -d``: no libgomp; ``GOMP_parallel`` undefined), so the symbols resolve through
``libtorch_cpu.so`` to torch's own ``torch/lib/libgomp.so.1``, the only OpenMP runtime mapped.
Hence it follows ``torch.set_num_threads`` on the calling thread: a 32 Mi-element step took
38 ms with CPU time on one task at ``set_num_threads(1)`` and 20 ms on two tasks at 2. A build
that binds another runtime would not follow; :func:`_openmp_driver` checks, at wrap time, that
``omp_get_max_threads`` as seen from the extension follows torch's count, and otherwise also
sets that runtime's ``omp_set_num_threads`` around the step (restored afterwards).

Why not ``tune_step_threads(engine.optimizer.optimizer)``: ZeRO calls the inner optimizer's
``step()`` once per parameter group per engine step (``_optimizer_step`` narrows
``param_groups`` to one group each time; HF Trainer passes two groups, decay and no-decay), so a
wrapper that reports each ``step()`` would hand the tuner the groups' steps as separate,
unequal samples, and could switch setting between two groups of one step. Here the inner step
runs under the tuned count (an instance attribute wrapping ``DeepSpeedCPUAdam.step`` in
:func:`offload.thread_limit`) and its times are summed over the engine's step (an instance
attribute wrapping ``DeepSpeedZeroOptimizer.step``), one sample per engine step; no object is
replaced, so DeepSpeed's type checks and checkpoints see its own optimizers. :meth:`close`
removes both attributes.

Only the Adam kernel's thread count is tuned: the gradient norm (a reduction whose last bits
depend on the thread count), unscale and clip, and the fp32 -> bf16 copy run at the caller's
count, so the parameters are bitwise those of the untuned engine (the kernel is elementwise;
tests/test_client_deepspeed.py checks it). Nothing else of that step can change between steps
without changing numbers or memory: ``pin_memory``, ``sub_group_size`` and bucket sizes are
fixed at ``initialize``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

from autotune import AutotuneConfig, TuningSession
from offload.threads._plan import ThreadPlan, thread_limit
from offload.tuning._glue import step_threads_space
from offload.tuning._node_agreement import thread_plan, tuning_config

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedTuning", "DeepSpeedTuningError", "deepspeed_workload", "tune_deepspeed"]


class DeepSpeedTuningError(ValueError):
    """An engine whose CPU Adam step ``tune_deepspeed`` cannot tune (the message says why)."""


def _openmp_driver(extension_file: str | None) -> Callable[[int], contextlib.AbstractContextManager[None]]:
    """A context manager factory that sets the thread count ``DeepSpeedCPUAdam``'s kernel uses:
    :func:`thread_limit` when the extension's OpenMP runtime follows torch's (checked at 1 and 2
    threads), else that and the extension's own ``omp_set_num_threads``."""
    get = put = None
    if extension_file:
        try:
            lib = ctypes.CDLL(extension_file, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            get, put = lib.omp_get_max_threads, lib.omp_set_num_threads
        except (OSError, AttributeError):
            get = put = None
    if get is None or put is None:
        return thread_limit
    get.restype, put.argtypes = ctypes.c_int, [ctypes.c_int]
    follows = True
    for n in (1, 2):
        with thread_limit(n):
            follows = follows and get() == n
    if follows:
        return thread_limit
    logger.warning("tune_deepspeed: %s binds an OpenMP runtime that does not follow torch.set_num_threads; "
                   "setting its omp_set_num_threads around each step too", extension_file)

    @contextlib.contextmanager
    def both(threads: int) -> Iterator[None]:
        previous = get()
        with thread_limit(threads):
            put(threads)
            try:
                yield
            finally:
                put(previous)

    return both


def deepspeed_workload(engine: Any) -> dict[str, Any]:
    """The fingerprint workload: DeepSpeed's version, the ZeRO stage, the data-parallel size,
    the model's global parameter count and dtypes (the same on every rank), the groups and
    CPU Adam's options."""
    import deepspeed

    zero = engine.optimizer
    inner = zero.optimizer
    params = list(engine.module.parameters())
    return {
        "optimizer": f"{type(inner).__module__}.{type(inner).__qualname__}",
        "deepspeed": deepspeed.__version__,
        "zero_stage": int(engine.zero_optimization_stage()),
        "dp_world_size": int(engine.dp_world_size),
        "params": sum(int(p.numel()) for p in params),
        "tensors": len(params),
        "dtypes": sorted({str(p.dtype) for p in params}),
        "groups": len(inner.param_groups),
        "adamw_mode": bool(getattr(inner, "adam_w_mode", True)),
        "fp32_optimizer_states": bool(getattr(inner, "fp32_optimizer_states", True)),
        "objective": "deepspeed-cpu-adam-step",
    }


class DeepSpeedTuning:
    """The tuning of one engine's CPU Adam step (made by :func:`tune_deepspeed`).

    ``session`` is the :class:`autotune.TuningSession` (None untuned), ``threads`` the count of
    the next step, ``last_step_s`` the summed CPU Adam time of the last engine step.
    """

    def __init__(self, engine: Any, *, plan: ThreadPlan, config: AutotuneConfig | None, agreement: Any,
                 clock: Callable[[], float]) -> None:
        self._zero = engine.optimizer
        self._inner = self._zero.optimizer
        self._clock = clock
        self._own_threads = plan.threads
        self._threads = plan.threads
        self._limit = _openmp_driver(getattr(getattr(self._inner, "ds_opt_adam", None), "__file__", None))
        self._pending: float | None = None
        self.last_step_s: float | None = None
        self.session: TuningSession | None = None
        fixed = plan.source != "plan"
        top = plan.threads if fixed else max(tuple(plan.local_threads) or (plan.threads,))
        inner_step, zero_step = self._inner.step, self._zero.step
        self._inner.step = self._tuned_inner_step(inner_step)
        self._zero.step = self._tuned_engine_step(zero_step)
        if config is not None:
            try:
                self.session = TuningSession(step_threads_space(max_threads=top, baseline_threads=top,
                                                                fixed_threads=fixed),
                                             baseline={"threads": top}, apply=self._apply, config=config,
                                             workload=deepspeed_workload(engine), group=agreement)
            except BaseException:
                self._restore()
                raise

    @property
    def threads(self) -> int:
        """Threads of the next CPU Adam step (the tuner's choice, capped at this rank's plan)."""
        return self._threads

    @property
    def tuner(self) -> Any:
        """The ``OnlineTuner`` (None untuned)."""
        return self.session.tuner if self.session is not None else None

    def summary(self) -> dict[str, Any]:
        """The tuner's summary (state, cache hit, probe steps, baseline, winner, ...); ``{}`` untuned."""
        return self.session.summary() if self.session is not None else {}

    def _apply(self, setting: dict[str, Any]) -> None:
        self._threads = min(int(setting["threads"]), self._own_threads)

    def _tuned_inner_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def tuned_step(*args: Any, **kwargs: Any) -> Any:
            with self._limit(self._threads):
                began = self._clock()
                out = step(*args, **kwargs)
                took = self._clock() - began
            self._pending = took if self._pending is None else self._pending + took
            return out

        return tuned_step

    def _tuned_engine_step(self, step: Callable[..., Any]) -> Callable[..., Any]:
        def engine_step(*args: Any, **kwargs: Any) -> Any:
            self._pending = None
            out = step(*args, **kwargs)
            took, self._pending = self._pending, None
            if took is not None:  # an overflow skips the CPU step on every rank alike: no sample
                self.last_step_s = took
                if self.session is not None:
                    self.session.observe(took if self.session.tuner.measuring else None)
            return out

        return engine_step

    def _restore(self) -> None:
        for obj in (self._inner, self._zero):
            vars(obj).pop("step", None)

    def close(self) -> None:
        """Give the engine its own steps back, write the trace summary, release the gloo group."""
        self._restore()
        if self.session is not None:
            self.session.close()

    def __repr__(self) -> str:
        state = self.session.state if self.session is not None else "off"
        return f"DeepSpeedTuning(threads={self._threads}, tuner={state})"


def tune_deepspeed(engine: Any, *, autotune: AutotuneConfig | bool = True, threads: int | None = None,
                   plan: ThreadPlan | None = None, clock: Callable[[], float] = time.perf_counter) -> DeepSpeedTuning:
    """Run the CPU Adam step of a ZeRO-Offload ``engine`` under a thread count the online tuner
    chooses (static plan first, the node's time the slowest local rank's, agreed, cached with
    DeepSpeed's version in the key, traced). Every rank of the node calls it together, after
    ``deepspeed.initialize``; train with ``engine`` as before.

    Args:
        engine: a ``deepspeed.initialize`` engine, ZeRO stage 1 or 2, ``offload_optimizer`` cpu,
            ``DeepSpeedCPUAdam``.
        autotune: ``True`` (``AutotuneConfig()``) or an ``AutotuneConfig``; ``False``: step at the
            thread plan's count, untuned.
        threads: a fixed count (nothing tuned); default ``plan_cpu_threads()``.
        plan: the thread plan to use (tests, simulations); not with ``threads``.
        clock: what each step is timed with (tests inject one).
    """
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = getattr(engine, "optimizer", None)
    if type(zero) is not DeepSpeedZeroOptimizer:  # a subclass (ZenFlow's) steps its own way
        raise DeepSpeedTuningError(
            f"tune_deepspeed: engine.optimizer is {type(zero).__name__}: expected DeepSpeedZeroOptimizer "
            "(ZeRO stage 1 or 2 with offload_optimizer: {device: cpu}; ZeRO-3, ZenFlow and SuperOffload are not "
            "supported)")
    if not zero.cpu_offload:
        raise DeepSpeedTuningError("tune_deepspeed: offload_optimizer is not on the CPU: the Adam step runs on "
                                   "the accelerator, where CPU threads do not matter")
    if type(zero.optimizer) is not DeepSpeedCPUAdam or getattr(zero, "zenflow", False):
        raise DeepSpeedTuningError(f"tune_deepspeed: the offloaded optimizer is {type(zero.optimizer).__name__}"
                                   f"{' (ZenFlow)' if getattr(zero, 'zenflow', False) else ''}: expected "
                                   "DeepSpeedCPUAdam")
    if "step" in vars(zero) or "step" in vars(zero.optimizer):
        raise DeepSpeedTuningError("tune_deepspeed: this engine's step is already wrapped (tune_deepspeed "
                                   "twice without close()?)")
    config = tuning_config(autotune, threads=threads, plan=plan, owner="tune_deepspeed", error=DeepSpeedTuningError)
    plan, agreement = thread_plan(config, threads=threads, plan=plan, owner="tune_deepspeed")
    tuning = DeepSpeedTuning(engine, plan=plan, config=config, agreement=agreement, clock=clock)
    logger.info("tune_deepspeed: CPU Adam steps with %d thread(s) now (tuner %s; plan %d: %s)", tuning.threads,
                tuning.session.state if tuning.session is not None else "off", plan.threads, plan.reason)
    return tuning
