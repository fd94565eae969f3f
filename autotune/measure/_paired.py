"""Paired, interleaved evidence: the statistic behind every decision the tuner makes.

Why paired. On a shared host the load changes from one second to the next (a data loader, a
tokenizer, a neighbour's job). Two candidates measured one after the other see different loads,
and the difference "manufactures phantom regret" (FlashInfer's autotune RFC). So every comparison
that decides something runs in *rounds*: each round visits every arm once, the order alternating
from round to round (A B, then B A), and the arms are compared round by round. A change of load
between rounds hits both arms alike; one within a round is split over both by the alternation.

Why the ratio of the arms' mean step times, and nothing filtered. A run's time is the sum of its
steps, so the mean is the objective. A setting whose OpenMP team oversubscribes the cores left free
by other work is fast now and then and many times slower otherwise: on this 2-core VM under two
2-thread torch loops, 2 threads ran 12 ms or 140 ms a step where 1 thread ran 22 ms. The rule the
tuner had first (leave out every sample above 1.5x the candidate's own fastest) let such a setting
win on its one lucky sample, 13.9x and 25.6x slower than the best (issue 36); a trimmed mean or a
median of per-round ratios still let it win when it was fast in most of a handful of rounds (6 of
20 sessions of stock AdamW kept 2 threads at 1.5-4.4x the mean step time of 1 thread,
``bench.tuner_load --load threads``). The ratio of the means counts every step: a sample is never
judged against its own candidate's other samples, and a stall of the machine that hits one arm of
one round weighs what it cost.

"Clearly faster" needs a ratio of means under ``1 - min_gain`` and an exact one-sided paired
permutation test (Fisher-Pitman: every sign flip of the per-round differences, their sum as the
statistic) at the level ``noise_factor`` names as a normal z-score (1.25: 10.6 %). It tests the
difference of the means itself, its level holds for any noise (between two equal settings it
fired on 6-11 % of comparisons of 4-8 rounds, Monte Carlo with 3-10 % normal noise, with and
without 15 % of steps stalled 2x), and it needs
:data:`MIN_DECIDING_ROUNDS` (= 4) rounds at the least (then all four must agree; from five on one
round may dissent if its difference is small). A round against the candidate by a large stall
defeats it until more rounds outweigh the stall: the duel runs on while the rounds disagree.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence, TypeVar

__all__ = [
    "EXACT_ROUNDS",
    "MIN_DECIDING_ROUNDS",
    "PairedComparison",
    "gain_margin",
    "permutation_p",
    "round_order",
]

T = TypeVar("T")

#: Fewest paired rounds behind a "clearly faster": below it the exact permutation test cannot
#: reach the default level (3 rounds that all agree have p = 1/8 = 12.5 %; 4 have 6.25 %).
MIN_DECIDING_ROUNDS = 4
#: Up to this many rounds the permutation test enumerates every sign flip (2**12 sums: a few ms
#: on rank 0 per decision); beyond, it draws :data:`SAMPLED_FLIPS` of them from a generator
#: seeded by the data (deterministic).
EXACT_ROUNDS = 12
SAMPLED_FLIPS = 4096
#: A step reported shorter than this (a clock's resolution; 0 s) counts as this long in a ratio.
SHORTEST_S = 1e-9


def gain_margin(min_gain: float) -> float:
    """``-log(1 - min_gain)``: the least a log ratio of mean times must fall below 0 to count as
    faster by more than ``min_gain`` (capped at 0.999).

    >>> round(gain_margin(0.01), 5)
    0.01005
    """
    return -math.log1p(-min(min_gain, 0.999))


def round_order(arms: Sequence[T], round_index: int) -> list[T]:
    """The visiting order of round ``round_index``: as given in even rounds, reversed in odd ones
    (A B, then B A), so a trend within a round favours no arm over two rounds.

    >>> round_order("ABC", 0), round_order("ABC", 1)
    (['A', 'B', 'C'], ['C', 'B', 'A'])
    """
    ordered = list(arms)
    return ordered if round_index % 2 == 0 else ordered[::-1]


def permutation_p(differences: Sequence[float]) -> float:
    """Exact one-sided p-value of the paired permutation test that the differences lean negative.

    Under the null each round's difference is as likely negative as positive: the p-value is the
    share of the ``2**n`` sign assignments whose sum is at most the observed sum (1.0 without
    rounds). Beyond :data:`EXACT_ROUNDS` rounds a fixed-seed sample of assignments stands in.

    >>> permutation_p([-1.0, -2.0, -3.0, -4.0])  # four of four: 1/16
    0.0625
    >>> permutation_p([-5.0, -5.0, -5.0, -5.0, 1.0])  # one small dissent in five: 2/32
    0.0625
    >>> permutation_p([-1.0, -1.0, -1.0, -1.0, 9.0]) > 0.5  # one large one outweighs them
    True
    """
    values = [float(d) for d in differences]
    n = len(values)
    if n == 0:
        return 1.0
    observed = math.fsum(values) + 1e-12 * max(1.0, max(abs(v) for v in values))  # ties count as at most
    magnitudes = [abs(v) for v in values]
    if n <= EXACT_ROUNDS:
        hits = sum(1 for signs in itertools.product((1.0, -1.0), repeat=n)
                   if math.fsum(s * m for s, m in zip(signs, magnitudes)) <= observed)
        return hits / 2.0 ** n
    rng = random.Random(hash(tuple(values)) & 0xFFFFFFFF)
    hits = sum(1 for _ in range(SAMPLED_FLIPS)
               if math.fsum(m if rng.random() < 0.5 else -m for m in magnitudes) <= observed)
    return (hits + 1) / (SAMPLED_FLIPS + 1)


@dataclass(frozen=True, slots=True)
class PairedComparison:
    """A candidate compared with a reference arm measured in the same rounds: ``candidate[i]`` and
    ``reference[i]`` are the two arms' step times in round ``i``.

    >>> c = PairedComparison.of([0.9, 0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0])
    >>> round(c.ratio, 3), c.clearly_faster(min_gain=0.01, noise_factor=1.25)
    (0.9, True)
    >>> lucky = PairedComparison.of([0.3, 5.0, 5.0, 5.0, 5.0], [1.0] * 5)  # fast once in five
    >>> lucky.ratio > 4, lucky.clearly_faster(min_gain=0.01, noise_factor=1.25)
    (True, False)
    >>> often = PairedComparison.of([0.6, 0.6, 0.6, 6.0, 0.6, 6.0], [1.0] * 6)  # faster in 4 of 6
    >>> often.ratio > 2, often.clearly_faster(min_gain=0.01, noise_factor=1.25)  # but slower on the mean
    (True, False)
    """

    candidate: tuple[float, ...]
    reference: tuple[float, ...]

    @classmethod
    def of(cls, candidate: Sequence[float], reference: Sequence[float]) -> PairedComparison:
        """From the two arms' times, round by round (the same number of rounds each, all >= 0;
        a time under :data:`SHORTEST_S` counts as that)."""
        if len(candidate) != len(reference):
            raise ValueError(
                f"PairedComparison: {len(candidate)} candidate rounds vs {len(reference)} reference rounds: "
                "expected one time per arm and round"
            )
        for a, b in zip(candidate, reference):
            if not (a >= 0 and b >= 0 and math.isfinite(a) and math.isfinite(b)):
                raise ValueError(f"PairedComparison: times {a!r}, {b!r}: expected finite seconds >= 0")
        return cls(tuple(max(float(a), SHORTEST_S) for a in candidate),
                   tuple(max(float(b), SHORTEST_S) for b in reference))

    def reversed(self) -> PairedComparison:
        """The reference compared with the candidate."""
        return PairedComparison(self.reference, self.candidate)

    @property
    def n(self) -> int:
        return len(self.candidate)

    @property
    def log_ratios(self) -> tuple[float, ...]:
        """Per round, ``log(candidate / reference)``: negative where the candidate was faster."""
        return tuple(math.log(a / b) for a, b in zip(self.candidate, self.reference))

    @property
    def effect(self) -> float:
        """``log`` of the ratio of the arms' mean step times over the rounds (0 without rounds)."""
        if not self.candidate:
            return 0.0
        return math.log(math.fsum(self.candidate) / math.fsum(self.reference))

    @property
    def ratio(self) -> float:
        """The candidate's mean step time over the reference's (below 1: faster)."""
        return math.exp(self.effect)

    def p_value(self) -> float:
        """One-sided exact paired permutation p-value that the candidate's mean is smaller
        (:func:`permutation_p` of the per-round differences)."""
        return permutation_p([a - b for a, b in zip(self.candidate, self.reference)])

    def clearly_faster(self, *, min_gain: float, noise_factor: float) -> bool:
        """The candidate beats the reference: a ratio of means under ``1 - min_gain`` and a
        permutation p-value at most ``1 - Phi(noise_factor)`` (10.6 % for 1.25), which takes at
        least :data:`MIN_DECIDING_ROUNDS` rounds."""
        if self.n < MIN_DECIDING_ROUNDS or -self.effect <= gain_margin(min_gain):
            return False
        return self.p_value() <= _level(noise_factor)

    def could_still_win(self, *, min_gain: float, noise_factor: float) -> bool:
        """More rounds could still make the candidate clearly faster: it was faster by more than
        ``min_gain`` in at least half of the rounds (or fewer than two rounds were run)."""
        if self.n < 2:
            return True
        margin = gain_margin(min_gain)
        return sum(1 for v in self.log_ratios if -v > margin) * 2 >= self.n

    def describe(self) -> str:
        """``faster in 5 of 6 paired rounds, mean time ratio 0.912, permutation p=0.031``."""
        faster = sum(1 for v in self.log_ratios if v < 0)
        return (f"faster in {faster} of {self.n} paired round(s), mean time ratio {self.ratio:.3f}, "
                f"permutation p={self.p_value():.3f}")


def _level(noise_factor: float) -> float:
    """The one-sided level a z-score of ``noise_factor`` names (1.25: 0.106)."""
    return 1.0 - NormalDist().cdf(noise_factor)
