"""Load episodes for ``bench.simulate``: contention that comes and goes, and hurts big thread teams most.

Why: the step model's noise (:class:`bench.simulate._stepmodel.NoiseModel`) is independent per step, but a
shared host is loaded in *episodes*: a data loader, a checkpoint writer or a neighbour's job runs for
a while, then stops. While it runs, its busy threads take cores, and an OpenMP team that needs more
cores than are left free is preempted in its barriers. This project measured it on its 2-core VM
(``bench/results/stock_threads.md`` against ``stock_threads-loaded.md``, load average 4-6): quiet,
2 threads ran 1.27x faster than 1 thread; loaded, 2 threads ran 2.7x *slower* than 1 thread, and
1 thread about 5x slower than quiet. So under load the best setting changes, and a tuner that probed
in a quiet spell keeps a setting that loses whenever an episode runs.

The load process (:func:`load_trace`): a seeded two-state Markov chain, quiet or loaded, with
geometric durations (means ``Contention.mean_quiet_steps`` and ``mean_episode_steps``: tens to
hundreds of steps); the first step's state is drawn from the chain's stationary distribution.
Each episode picks one of ``Contention.episodes`` uniformly: its busy threads per socket. The trace
is an int per step: 0 quiet, ``k`` the ``k``-th episode kind. It depends only on the seed and the
node's name (its own random stream: the measurement noise of a seed is the same with or without
contention), so the ground truth "mean step time of each setting over this run's load" is the
average of deterministic step times over the same trace (:mod:`bench.simulate._truth`).

The slowdown (:func:`busy_core_ratio`, :func:`team_slowdown`; ``Node.kernel_rates(load=)`` applies
them): a socket's busy threads are spread over its CPU classes in proportion to their cores, and
the loaded cores are not available to the optimizer. In a class of ``C`` cores with ``L`` busy
threads, ``F = max(0, C - L)`` cores are free. The optimizer threads of every rank in the class
(``T``, at most ``C``: threads beyond the cores are the quiet model's SMT and oversubscription)
run on the free cores first; the ``E = T - F`` that do not fit share the ``B = C - F`` busy cores
with the load: ``(E + L) / B`` runnable threads per busy core (``ratio``, 1 when the team fits).
A team waits for its slowest thread at every barrier, so a rank of ``n`` threads in a class with
``ratio > 1`` is slower by ``1 + p * (ratio - 1)``, where ``p = 1 + (oversub_penalty - 1) * (1 -
1/n)``: one thread has no barrier and is only time-shared (``p = 1``, the slowdown is its share of
a core); a large team pays the model's own oversubscription penalty (``Hardware.oversub_penalty``,
the barrier stalls of step 2 of the step model). The rank's slowdown is the worst over its classes.
A team that fills every core is hit by any episode (``ratio`` 2: each busy core runs one of its
threads beside one of the load's), a team that leaves as many cores free as the load takes by none.
Example (the VM's case): 2 cores, 4 busy threads: 1 thread runs 2.5x slower than quiet, a 2-thread
team 6x; with the VM's quiet 1.27x gain from the second thread, 2 threads end 1.9x slower than 1
under load (2.7x measured there: the model is on the mild side).

Not modelled: the load's memory bandwidth (it is taken to be compute-bound, as decoding in a data
loader is), SMT siblings of busy cores (counted as time slices of them) and load inside one rank's
mask only (a socket's load is spread over all its CPUs).
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

__all__ = ["Contention", "busy_core_ratio", "load_trace", "team_slowdown"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Contention:
    """The load episodes of a node (the module doc says how they slow a setting)."""

    episodes: tuple[tuple[float, ...], ...]
    """Each episode kind's busy threads per socket; an episode picks one kind uniformly."""
    mean_quiet_steps: float = 150.0
    """Mean length of a quiet spell, in steps (geometric)."""
    mean_episode_steps: float = 100.0
    """Mean length of a load episode, in steps (geometric)."""

    def __post_init__(self) -> None:
        if not self.episodes:
            raise ValueError("Contention.episodes=(): expected at least one episode kind")
        for kind in self.episodes:
            if not kind or any(not (isinstance(x, (int, float)) and math.isfinite(x) and x >= 0) for x in kind):
                raise ValueError(f"Contention.episodes: {kind!r}: expected busy threads per socket, numbers >= 0")
        if len({len(k) for k in self.episodes}) != 1:
            raise ValueError(f"Contention.episodes={self.episodes!r}: expected the same number of sockets in each")
        for name in ("mean_quiet_steps", "mean_episode_steps"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 1):
                raise ValueError(f"Contention.{name}={value!r}: expected a finite number >= 1")

    @property
    def loaded_share(self) -> float:
        """The long-run share of steps inside an episode (the chain's stationary probability)."""
        return self.mean_episode_steps / (self.mean_episode_steps + self.mean_quiet_steps)

    @property
    def levels(self) -> tuple[tuple[float, ...], ...]:
        """Busy threads per socket of each trace value: level 0 is quiet, level ``k`` episode kind ``k``."""
        return ((0.0,) * len(self.episodes[0]), *(tuple(float(x) for x in k) for k in self.episodes))

    @property
    def level_weights(self) -> tuple[float, ...]:
        """The long-run share of steps at each level (quiet first)."""
        each = self.loaded_share / len(self.episodes)
        return (1.0 - self.loaded_share, *([each] * len(self.episodes)))


def load_trace(contention: Contention, name: str, seed: int, steps: int) -> np.ndarray:
    """The load level of each of ``steps`` steps (0 quiet, ``k`` episode kind ``k``) for run ``seed``
    of node ``name``: seeded by both, on a stream apart from the measurement noise's."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"load_trace: steps={steps!r}: expected an int >= 0")
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), 0xC047])
    trace = np.zeros(steps, dtype=np.int64)
    loaded = bool(rng.random() < contention.loaded_share)
    pos = 0
    while pos < steps:
        mean = contention.mean_episode_steps if loaded else contention.mean_quiet_steps
        length = int(rng.geometric(1.0 / mean))
        if loaded:
            trace[pos:pos + length] = 1 + int(rng.integers(len(contention.episodes)))
        pos += length
        loaded = not loaded
    return trace


def busy_core_ratio(team_threads: float, cores: int, busy: float) -> float:
    """Runnable threads per busy core that the optimizer threads beyond the free cores meet
    (1.0 when ``team_threads`` fit on the ``cores - busy`` free cores)."""
    if busy <= 0:
        return 1.0
    free = max(0.0, cores - busy)
    placed = min(team_threads, float(cores))
    if placed <= free:
        return 1.0
    return (placed - free + busy) / (cores - free)


def team_slowdown(ratio: float, team: int, oversub_penalty: float) -> float:
    """How much slower a team of ``team`` threads runs at ``ratio`` runnable threads per core."""
    if ratio <= 1.0:
        return 1.0
    penalty = 1.0 + (oversub_penalty - 1.0) * (1.0 - 1.0 / team)
    return 1.0 + penalty * (ratio - 1.0)
