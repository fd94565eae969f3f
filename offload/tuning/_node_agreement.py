"""One agreement per node: the node-local collectives of a tuned optimizer, set up in one place.

A tuned optimizer (``CPUOffloadAdamW(autotune=...)``, ``tune_step_threads``) runs three kinds of
node-local collectives: the thread plan's exchange of affinity masks, the vote on the fused-mp
kernel knob (``offload.tuning._glue``) and the tuner's own agreement (cache decision, step times,
lock-in). A gloo group per kind would be three rendezvous of every rank at construction, so
:func:`node_agreement` makes one ``autotune`` agreement (a gloo group over this node's ranks with the tuner's timeout, or a ``LocalAgreement``
in a single process) and all three go through it; its owner closes it once.

An untuned optimizer needs only the thread plan: ``plan_cpu_threads`` keeps its own group there
(made once per process, joined by this node's ranks only, where an agreement group would need
every rank of the job).
"""

from __future__ import annotations

from typing import Any

from autotune import AutotuneConfig
from autotune import Agreement, make_agreement
from offload.threads._plan import ThreadPlan, plan_cpu_threads

__all__ = ["NodeAgreement", "node_agreement", "plan_with", "thread_plan", "tuning_config"]


class NodeAgreement:
    """The node's agreement, shared by the thread plan, the kernel vote and the tuner.

    Delegates the collectives; :meth:`close` closes the agreement once, whoever calls it first
    (the tuner closes the agreement it was given, and the owner closes it too).
    """

    __slots__ = ("_inner", "rank", "world_size", "closed")

    def __init__(self, inner: Agreement) -> None:
        self._inner = inner
        self.rank: int = inner.rank
        self.world_size: int = inner.world_size
        self.closed = False

    def broadcast(self, obj: Any, *, step: int | None, what: str) -> Any:
        return self._inner.broadcast(obj, step=step, what=what)

    def all_gather(self, obj: Any, *, step: int | None, what: str) -> list[Any]:
        return self._inner.all_gather(obj, step=step, what=what)

    def max_float(self, value: float, *, step: int | None, what: str) -> float:
        return self._inner.max_float(value, step=step, what=what)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._inner.close()

    def __repr__(self) -> str:
        return f"NodeAgreement({self._inner!r})"


def node_agreement(*, timeout_s: float, owner: str) -> NodeAgreement:
    """The agreement over this node's ranks: a gloo group when torch.distributed is initialised
    with several ranks (every rank of the job must call this together), else one process's."""
    return NodeAgreement(make_agreement(None, timeout_s=timeout_s, owner=owner))


def plan_with(agreement: NodeAgreement, *, threads: int | None, bind_node: int | None = None) -> ThreadPlan:
    """``plan_cpu_threads(threads=threads, bind_node=bind_node)`` with the masks exchanged through
    ``agreement`` (where it spans several ranks; in one process the plan is made exactly as without it)."""
    if agreement.world_size > 1:
        return plan_cpu_threads(threads=threads, agreement=agreement, bind_node=bind_node)
    return plan_cpu_threads(threads=threads, bind_node=bind_node)


def tuning_config(autotune: bool | AutotuneConfig, *, threads: int | None, plan: ThreadPlan | None, owner: str,
                  error: type[Exception]) -> AutotuneConfig | None:
    """The config of a tuning wrapper's ``autotune=`` (True: the defaults; False: None, untuned),
    with its ``threads=`` and ``plan=`` checked: ``TypeError`` for a wrong type, ``error`` when
    both are given."""
    if autotune is True:
        autotune = AutotuneConfig()
    if autotune is not False and not isinstance(autotune, AutotuneConfig):
        raise TypeError(f"{owner}: autotune={autotune!r}: expected a bool or an autotune.AutotuneConfig")
    if plan is not None and threads is not None:
        raise error(f"{owner}: threads={threads!r} and plan=...: pass one of them")
    if plan is not None and not isinstance(plan, ThreadPlan):
        raise TypeError(f"{owner}: plan={plan!r}: expected an offload.ThreadPlan")
    return autotune or None


def thread_plan(config: AutotuneConfig | None, *, threads: int | None, plan: ThreadPlan | None,
                owner: str, bind_node: int | None = None) -> tuple[ThreadPlan, NodeAgreement | None]:
    """The thread plan of an optimizer (``plan`` when given) and, when tuned (``config``), the
    node agreement it was exchanged through, for the kernel vote and the tuner. ``bind_node``: the
    NUMA node this rank would bind to (``ThreadPlan.bound_threads``, for the ``bind_numa`` knob)."""
    agreement = node_agreement(timeout_s=config.timeout_s, owner=owner) if config is not None else None
    if plan is None:
        plan = (plan_with(agreement, threads=threads, bind_node=bind_node) if agreement is not None
                else plan_cpu_threads(threads=threads, bind_node=bind_node))
    return plan, agreement
