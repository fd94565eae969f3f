"""Paired, interleaved evidence: the statistic behind every decision the tuner makes.

Why paired. On a shared host the load changes from one second to the next (a data loader, a
tokenizer, a neighbour's job). Two candidates measured one after the other see different loads,
and the difference "manufactures phantom regret" (FlashInfer's autotune RFC). So every comparison
that decides something runs in *rounds*: each round visits every arm once, the order alternating
from round to round (A B, then B A), and the comparison is made per round, as the log of the
ratio of the two arms' times. A change of load between rounds cancels; one within a round is
split over both arms by the alternation.

Why a trimmed mean of log-ratios, and not a filter on each candidate's own samples. A setting
whose OpenMP team oversubscribes the cores left free by other work is preempted in its barriers:
it is slow most of the time and fast now and then. The rule the tuner had before (leave out every
sample above 1.5x the candidate's *own fastest*) threw that slowness away and let such a setting
win on its one lucky sample: on this 2-core VM under two 2-thread torch loops, 2 threads locked
in at 13.9x and 25.6x the step time of 1 thread (issue 36). Here a sample is never judged against
its own candidate: a round's ratio is judged only against the other rounds' ratios. The trimmed
mean drops the ``trim_count(n)`` most extreme rounds on *each* side (one of three to seven
rounds, a quarter beyond): a stall that hits one arm of one round (a checkpoint, a page-cache
flush, one rank's hiccup) is discounted, whichever arm it hit, while a setting that is slow in
most rounds is slow in the middle of the ordered ratios, where nothing is trimmed. It is a
mean, not a median, of what is left, because a run's time is the sum of its steps: a setting
slow in a third of the rounds must pay for them.

"Clearly faster" needs a trimmed-mean gain beyond the minimum margin and evidence at the level
``noise_factor`` names as a normal z-score (1.25: 10.6 %), from either of two tests:
Wilcoxon's exact signed-rank test, whose level holds for any noise but which needs
:data:`MIN_DECIDING_ROUNDS` (= 4) rounds that all agree at the least, so one stalled step in the
candidate's arm defeats it; or Yuen's trimmed-mean statistic against critical values calibrated
by Monte Carlo (:data:`YUEN_CRITICAL`), which discounts that round (also from 4 rounds on). (The textbook z rule on the
trimmed mean's standard error fired on 19-25 % of comparisons of two *equal* settings with 3-6
rounds: so few rounds estimate the spread badly.) On ``python -m bench.simulate``'s 8-rank nodes,
50 seeds, the rank test alone kept a static plan 6-31 % slower than the best in 20-56 % of
sessions; with either test, the median regret fell from 1.2-6.1 % to 0.0 %.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Sequence, TypeVar

__all__ = [
    "MIN_DECIDING_ROUNDS",
    "PairedComparison",
    "round_order",
    "signed_rank_p",
    "trim_count",
]

T = TypeVar("T")

#: Fewest paired rounds behind a "clearly faster": below it the exact signed-rank test cannot reach
#: the default level (3 rounds that all agree have p = 1/8 = 12.5 %; 4 have 6.25 %).
MIN_DECIDING_ROUNDS = 4
#: Critical values of :meth:`PairedComparison.yuen_statistic` at a one-sided 10.6 % (the level of
#: the default ``noise_factor``, 1.25) per number of rounds: the largest 89.4th percentile of the
#: statistic between two *equal* settings over per-step normal noise of 0.5-30 % and 0, 15 or 30 %
#: of steps stalled to 2x per arm (200,000 draws each; the stalls make the small-round values
#: larger). With 4 rounds one is trimmed from each end and two are left: hence its large value.
#: Beyond 12 rounds the 12-round value.
YUEN_CRITICAL = {3: 2.12, 4: 4.23, 5: 2.13, 6: 1.74, 7: 1.58, 8: 1.83, 9: 1.63, 10: 1.53, 11: 1.47, 12: 1.56}
#: The ``noise_factor`` :data:`YUEN_CRITICAL` was computed for; others scale it proportionally.
NOISE_FACTOR_OF_TABLE = 1.25
#: A step reported shorter than this (a clock's resolution; 0 s) counts as this long in a ratio.
SHORTEST_S = 1e-9


def trim_count(n: int) -> int:
    """Rounds dropped from each end of the ordered log-ratios: none below 3 rounds, then one,
    and a quarter (rounded down) from 8 rounds on.

    >>> [trim_count(n) for n in (1, 2, 3, 4, 7, 8, 12)]
    [0, 0, 1, 1, 1, 2, 3]
    """
    if n < 3:
        return 0
    return max(1, n // 4)


def round_order(arms: Sequence[T], round_index: int) -> list[T]:
    """The visiting order of round ``round_index``: as given in even rounds, reversed in odd ones
    (A B, then B A), so a trend within a round favours no arm over two rounds.

    >>> round_order("ABC", 0), round_order("ABC", 1)
    (['A', 'B', 'C'], ['C', 'B', 'A'])
    """
    ordered = list(arms)
    return ordered if round_index % 2 == 0 else ordered[::-1]


def signed_rank_p(differences: Sequence[float]) -> float:
    """Exact one-sided p-value of Wilcoxon's signed-rank test that the differences lean negative.

    Zero differences are dropped; tied magnitudes get their average rank. Under the null each
    rank's sign is + or - with probability 1/2; the p-value is the probability that the sum of
    the ranks with a negative sign reaches the observed one (1.0 without non-zero differences).

    >>> signed_rank_p([-1.0, -2.0, -3.0, -4.0])  # four of four: 1/16
    0.0625
    >>> signed_rank_p([-1.0, -2.0, 3.0]) > 0.5
    True
    """
    values = [d for d in differences if d != 0.0]
    n = len(values)
    if n == 0:
        return 1.0
    order = sorted(range(n), key=lambda i: abs(values[i]))
    doubled = [0] * n  # twice the average ranks: integers even with ties
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(values[order[j + 1]]) == abs(values[order[i]]):
            j += 1
        for position in range(i, j + 1):
            doubled[order[position]] = i + j + 2  # (i + 1) + (j + 1)
        i = j + 1
    observed = sum(r for r, v in zip(doubled, values) if v < 0)
    counts = {0: 1}  # the null distribution of the (doubled) negative rank sum
    for r in doubled:
        grown = dict(counts)
        for total, ways in counts.items():
            grown[total + r] = grown.get(total + r, 0) + ways
        counts = grown
    return sum(ways for total, ways in counts.items() if total >= observed) / 2.0 ** n


@dataclass(frozen=True, slots=True)
class PairedComparison:
    """The per-round comparison of a candidate with a reference arm measured in the same rounds.

    ``log_ratios[i] = log(candidate_time_i / reference_time_i)``: negative where the candidate was
    faster in round ``i``.

    >>> c = PairedComparison.of([0.9, 0.9, 0.9, 0.9], [1.0, 1.0, 1.0, 1.0])
    >>> round(c.ratio, 3), c.clearly_faster(min_gain=0.01, noise_factor=1.25)
    (0.9, True)
    >>> lucky = PairedComparison.of([0.3, 5.0, 5.0, 5.0, 5.0], [1.0] * 5)  # fast once in five
    >>> lucky.ratio > 4, lucky.clearly_faster(min_gain=0.01, noise_factor=1.25)
    (True, False)
    """

    log_ratios: tuple[float, ...]

    @classmethod
    def of(cls, candidate: Sequence[float], reference: Sequence[float]) -> PairedComparison:
        """From the two arms' times, round by round (the same number of rounds each, all >= 0;
        a time under :data:`SHORTEST_S` counts as that)."""
        if len(candidate) != len(reference):
            raise ValueError(
                f"PairedComparison: {len(candidate)} candidate rounds vs {len(reference)} reference rounds: "
                "expected one time per arm and round"
            )
        ratios = []
        for a, b in zip(candidate, reference):
            if not (a >= 0 and b >= 0 and math.isfinite(a) and math.isfinite(b)):
                raise ValueError(f"PairedComparison: times {a!r}, {b!r}: expected finite seconds >= 0")
            ratios.append(math.log(max(a, SHORTEST_S) / max(b, SHORTEST_S)))
        return cls(tuple(ratios))

    def reversed(self) -> PairedComparison:
        """The reference compared with the candidate (every log-ratio negated)."""
        return PairedComparison(tuple(-v for v in self.log_ratios))

    @property
    def n(self) -> int:
        return len(self.log_ratios)

    def _trimmed(self) -> tuple[list[float], int]:
        ordered = sorted(self.log_ratios)
        k = trim_count(len(ordered))
        return ordered, k

    @property
    def effect(self) -> float:
        """Trimmed mean of the log-ratios (0 without rounds): ``exp(effect)`` is the typical ratio."""
        if not self.log_ratios:
            return 0.0
        ordered, k = self._trimmed()
        kept = ordered[k: len(ordered) - k]
        return math.fsum(kept) / len(kept)

    @property
    def ratio(self) -> float:
        """``exp(effect)``: candidate time / reference time, typically (below 1: faster)."""
        return math.exp(self.effect)

    def p_value(self) -> float:
        """One-sided exact signed-rank p-value that the candidate is faster (:func:`signed_rank_p`)."""
        return signed_rank_p(self.log_ratios)

    def yuen_statistic(self) -> float:
        """Yuen's statistic: the trimmed mean's gain over its winsorized standard error
        (Tukey-McLaughlin); infinite for a gain without spread, -inf below two rounds."""
        n = self.n
        if n < 2:
            return -math.inf
        ordered, k = self._trimmed()
        gain = -math.fsum(ordered[k: n - k]) / (n - 2 * k)
        if n - 2 * k < 2:
            k = 0  # three rounds: winsorizing to the median would leave no spread; use all of them
        low, high = ordered[k], ordered[n - 1 - k]
        winsorized = [min(max(v, low), high) for v in ordered]
        mean = math.fsum(winsorized) / n
        spread = math.sqrt(math.fsum((v - mean) ** 2 for v in winsorized) / (n - 1))
        if spread == 0.0:
            return math.inf if gain > 0 else -math.inf
        return gain / (spread / ((n - 2 * k) / n * math.sqrt(n)))

    def clearly_faster(self, *, min_gain: float, noise_factor: float, yuen: bool = True) -> bool:
        """The candidate beats the reference: a trimmed-mean gain beyond ``min_gain``, and either
        the exact signed-rank test at the level ``noise_factor`` names (p at most ``1 -
        Phi(noise_factor)``, 10.6 % for 1.25) or Yuen's statistic beyond its critical value
        (:data:`YUEN_CRITICAL`, scaled by ``noise_factor / 1.25``). Either needs at least
        :data:`MIN_DECIDING_ROUNDS` (4) rounds; the rank test four that all agree. (With three,
        Yuen's statistic moved 3 of 20 sessions of CPUOffloadAdamW on this 2-core VM under two
        2-thread torch loops to a setting 24-42 % slower: the spread of three rounds of a load that
        comes and goes is no estimate.)"""
        if self.n < MIN_DECIDING_ROUNDS or -self.effect <= -math.log1p(-min(min_gain, 0.999)):
            return False
        if self.p_value() <= _level(noise_factor):
            return True
        if not yuen:
            return False
        critical = YUEN_CRITICAL.get(self.n, YUEN_CRITICAL[max(YUEN_CRITICAL)])
        return self.yuen_statistic() > critical * noise_factor / NOISE_FACTOR_OF_TABLE

    def could_still_win(self, *, min_gain: float, noise_factor: float) -> bool:
        """More rounds could still make the candidate clearly faster: it was faster by more than
        ``min_gain`` in at least half of the rounds (or fewer than two rounds were run)."""
        if self.n < 2:
            return True
        margin = -math.log1p(-min(min_gain, 0.999))
        return sum(1 for v in self.log_ratios if -v > margin) * 2 >= self.n

    def describe(self) -> str:
        """``faster in 5 of 6 paired rounds, trimmed-mean time ratio 0.912, signed-rank p=0.031``."""
        faster = sum(1 for v in self.log_ratios if v < 0)
        return (f"faster in {faster} of {self.n} paired round(s), trimmed-mean time ratio {self.ratio:.3f}, "
                f"signed-rank p={self.p_value():.3f}")


def _level(noise_factor: float) -> float:
    """The one-sided level a z-score of ``noise_factor`` names (1.25: 0.106)."""
    return 1.0 - NormalDist().cdf(noise_factor)
