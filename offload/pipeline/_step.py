"""The jobs of one ``step()``: one job per chunk, in chunk order (the gradients are the engine's:
``offload._engine.HostEngine.collect_grads``).

A chunk whose early job was committed (``committed``: the jobs an overlap with backward ran and
found valid) only writes its weights (its kernel ran during backward), submitted as soon as it
was judged (:func:`write_job`); every other chunk with a gradient runs d2h, kernel and
materialize with this step's hyper-parameters (clip coefficient and grad scale included). In a
slab segment a chunk of which started during backward (``out_of_place``) every chunk updates out
of place, into the second generation of the slabs, and :func:`commit_generations` then makes that
generation the committed one (a swap), or, after a failure part-way, keeps what ran.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from offload.pipeline._jobs import ChunkJob
from offload.kernels._adamw import Hyper
from offload.pipeline._pipeline import Pipeline
from offload.state._layout import HostLayout
from offload.state._slabs import StorageSwap, View

__all__ = ["StepJobs", "commit_generations", "keep_views", "part_stepped", "submit_step", "write_job"]


@dataclass(slots=True)
class StepJobs:
    """What :func:`submit_step` submitted."""

    updates: list[ChunkJob] = field(default_factory=list)
    """The jobs that update state in ``step()`` (not the committed speculations)."""
    numel: int = 0
    """Elements of all submitted chunks."""
    chunks: int = 0
    """Chunks submitted."""
    native: bool = False
    """Some item runs on the native kernel."""


def write_job(early: ChunkJob, *, threads: int, event: Any) -> ChunkJob:
    """The job that writes the weights of a committed early chunk (its kernel ran during backward,
    into the second generation): submitted as soon as ``step()`` judged it, before the step's
    update jobs, so the writes run while later chunks are still being checked."""
    return ChunkJob(chunk=early.chunk, items=early.items, hyper=early.hyper, threads=threads, update=False,
                    materialize=True, into_next=True, write_event=event)


def submit_step(pipeline: Pipeline, layout: HostLayout, committed: Mapping[int, ChunkJob],
                grads: Mapping[int, Tensor], state: Mapping[Tensor, dict[str, Any]], *,
                hyper_now: Callable[[int], Hyper], kernel: str, threads: int, event: Any,
                out_of_place: Collection[int] = (), out: StepJobs | None = None) -> StepJobs:
    """Submit the update job of every chunk not in ``committed`` (whose weight writes were
    submitted already, :func:`write_job`), see the module doc; ``out_of_place``: the slab
    segments whose chunks update into the second generation; ``out``: where the jobs are
    recorded as they are made (each before it is queued), so a caller whose submission failed
    part-way knows every job that may have run."""
    out = StepJobs() if out is None else out
    items, records, sharded = layout.items, layout.records, layout.registry.sharded
    for chunk in layout.chunks:
        early = committed.get(chunk.index)
        if early is not None:  # its kernel ran during backward; its weights are being written
            its = early.items
        else:
            hyper = hyper_now(chunk.group)
            its = items.items(chunk, grads, records, state, kernel=kernel, sharded=sharded)
            if not its:
                continue
            job = ChunkJob(chunk=chunk.index, items=its, hyper=hyper, threads=threads, update=True,
                           materialize=True, ready_event=event, into_next=chunk.segment in out_of_place,
                           write_event=event)
            out.updates.append(job)  # first: see ``out``
            pipeline.submit(job)
        n, native = items.summary(chunk, its)
        out.native = out.native or native
        out.numel += n
        out.chunks += 1
    return out


def commit_generations(layout: HostLayout, segments: Collection[int], grads: Mapping[int, Tensor],
                       jobs: Sequence[ChunkJob], *, error: bool, failed: bool, swap: StorageSwap | None) -> None:
    """After the drain of a step that updated ``segments`` out of place (``jobs``: the committed
    early jobs and the step's update jobs): on success, the slots of those segments that had no
    gradient carry their state into the second generation and the segments' generations are
    swapped (``HostSlabs.swap``); ``failed`` (nothing updated in ``step()``): nothing is committed,
    the early chunks are dropped; another ``error``: the chunks whose kernel ran keep their update
    (copied back), as an update in place would have, and the others their committed state."""
    slabs = layout.slabs
    if failed:
        return
    if error:
        keep_views(layout, [it.view for job in jobs if job.progress.kernel_ran and job.into_next for it in job.items])
        return
    slabs.carry(s.index for s in slabs.slots if s.segment in segments and s.index not in grads and slabs.used[s.index])
    slabs.swap(sorted(segments), swap)


def part_stepped(layout: HostLayout, updates: Sequence[ChunkJob], writes: Sequence[ChunkJob], *,
                 failed: bool) -> list[int]:
    """The slots a failed step left part-stepped, after its drain: a parameter some of whose
    elements have this step's update and others the last step's, or whose master and weight
    disagree, or that a kernel call which raised may have written part of. ``updates``: the
    step's update jobs (recorded before they were queued: :class:`StepJobs`); ``writes``: the
    weight writes of the committed early chunks (their kernels ran during backward, into the
    second generation); ``failed``: nothing of the step landed and the early chunks are dropped
    (``Launcher.finish_step``). An element landed when its kernel ran and its weights were
    written (what the worker noted in each job's ``JobProgress``); an out-of-place update that did
    not land is not kept (``commit_generations``)."""
    landed: dict[int, int] = {}
    partial: set[int] = set()

    def add(job: ChunkJob) -> None:
        for it in job.items:
            landed[it.view.slot] = landed.get(it.view.slot, 0) + it.view.numel

    for job in updates:
        done = job.progress
        if done.kernel_ran and done.materialized and not (failed and job.into_next):
            add(job)
        elif done.kernel_started or done.writing:  # a kernel call or a weight write raised part-way
            partial.update(it.view.slot for it in job.items)
    for job in writes:
        if job.progress.materialized:
            add(job)
        elif job.progress.writing or not failed:  # written part-way, or its master kept and its weight not written
            partial.update(it.view.slot for it in job.items)
    slots = layout.slabs.slots
    partial.update(s for s, n in landed.items() if n < slots[s].numel)
    return sorted(partial)


def keep_views(layout: HostLayout, views: Sequence[View]) -> None:
    """The update of ``views``, made out of place, kept as if it had been made in place: the
    second generation copied into the committed slabs (``HostSlabs.keep``) and, where a parameter
    is its own master, its new master into the parameter."""
    slabs = layout.slabs
    slabs.keep(views)
    for v in views:
        if slabs.slots[v.slot].own_master:
            layout.records[v.slot].local().detach().view(-1)[v.start : v.stop].copy_(slabs.next_view("master", v))
