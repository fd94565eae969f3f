"""The lock-in rules of a probing session: on paired rounds (:func:`decide_paired`, the rule) and,
for a session without paired rounds (no finals), on unpaired medians (:func:`choose`).

Kept apart from the schedule of :mod:`autotune.decide._probe` (what the next step runs) because they
are the part a reader checks against the statistics of :mod:`autotune.measure._paired`.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from autotune._config import AutotuneConfig
from autotune.measure._measurement import Measurement, format_ms, gain_threshold, significantly_faster
from autotune.measure._paired import MIN_DECIDING_ROUNDS, PairedComparison, gain_margin
from autotune.measure._space import Scalar, SearchSpace

__all__ = ["choose", "decide_paired", "lighter_lead", "paired_comparisons"]

Key = tuple[Scalar, ...]

#: Fewest paired rounds behind a lean (:func:`lighter_lead`): twice the rounds a "clearly faster"
#: needs. A session reaches them only where the duel ran long (a small space, such as stock AdamW's
#: thread counts, whose rounds kept disagreeing); with the 3-5 rounds of a larger space a lean was
#: noise: on the 2-core VM under two 2-thread torch loops, with 3 rounds, 4 of 30 sessions of
#: CPUOffloadAdamW leaned to 1 thread at 15-20 % above the best (none without the lean).
LEAN_ROUNDS = 8


def choose(
    space: SearchSpace, baseline: Key, measurements: dict[Key, Measurement], config: AutotuneConfig
) -> tuple[Key, str]:
    """The lock-in rule of a session without paired rounds (no finals: ``finalists`` < 2 or
    ``final_rounds`` = 0), on every candidate's unfiltered samples. Returns ``(winner, reason)``.

    The fastest median wins, candidates within ``tie_tolerance`` of it count as tied and the
    space's preference breaks the tie (fewer threads, then larger chunks). The static plan stays
    if it is among the tied, or unless the winner beats it by more than ``max(min_gain *
    median_plan, noise_factor * standard error of the difference of the medians)``
    (:func:`autotune.measure._measurement.gain_threshold`). Nothing is filtered: a candidate's slow
    samples are its own (a setting slow four times in five must not win on its fifth).
    """
    best = min(m.median for m in measurements.values())
    tied = [k for k, m in measurements.items() if m.median <= best * (1.0 + config.tie_tolerance)]
    if baseline in tied:
        return baseline, "the static plan is as fast as the fastest candidate"
    winner = min(tied, key=lambda k: space.preference(space.setting(k)))
    base, win = measurements[baseline], measurements[winner]
    threshold = gain_threshold(base, win, min_gain=config.min_gain, noise_factor=config.noise_factor)
    gain = base.median - win.median
    if significantly_faster(win, base, min_gain=config.min_gain, noise_factor=config.noise_factor):
        return winner, f"gain {format_ms(gain)} > threshold {format_ms(threshold)} on the medians (unpaired)"
    return baseline, (
        f"best candidate {space.describe(space.setting(winner))} is not clearly faster than the static plan "
        f"(gain {format_ms(gain)} <= threshold {format_ms(threshold)} on the medians, unpaired)"
    )


def paired_comparisons(rounds: list[dict[Key, float]], baseline: Key) -> dict[Key, PairedComparison]:
    """Every arm's :class:`PairedComparison` with ``baseline`` over the rounds that measured both."""
    arms = {k for r in rounds for k in r if k != baseline}
    out = {}
    for key in arms:
        common = [r for r in rounds if key in r and baseline in r]
        if common:
            out[key] = PairedComparison.of([r[key] for r in common], [r[baseline] for r in common])
    return out


def decide_paired(
    space: SearchSpace, baseline: Key, rounds: list[dict[Key, float]], config: AutotuneConfig, *,
    final: bool = True,
) -> tuple[Key, str, Key | None]:
    """The lock-in rule on paired rounds. Returns ``(winner, reason, runner_up)``.

    Each arm is compared with the static plan over the rounds that measured both
    (:class:`~autotune.measure._paired.PairedComparison`: the ratio of the mean step times). Only arms
    clearly faster than the plan may replace it (:meth:`PairedComparison.clearly_faster`: a ratio
    under ``1 - min_gain`` and an exact paired permutation test at the level ``noise_factor``
    names); of those the smallest ratio wins, arms within ``tie_tolerance`` of it are tied and the
    space's preference breaks the tie. Without such an arm the static plan stays, unless ``final``
    (the budget is spent) and a lighter arm leans faster (:func:`lighter_lead`: under doubt the
    lighter setting is the safer one). ``runner_up``:
    the best arm that is neither the winner nor the static plan (the static plan when nothing else was measured
    beside a winner), the post-lock watch's first challenger; None when nothing else was measured.
    """
    comparisons = paired_comparisons(rounds, baseline)
    effects = {k: c.effect for k, c in comparisons.items()}
    effects[baseline] = 0.0
    tie = math.log1p(config.tie_tolerance)
    order = sorted(effects, key=lambda k: (effects[k], space.preference(space.setting(k))))
    # Only an arm with the evidence can replace the static plan: one measured in fewer rounds
    # (not the duel's) may look faster on them, but cannot outvote a duel that settled.
    clear = [k for k, c in comparisons.items()
             if c.clearly_faster(min_gain=config.min_gain, noise_factor=config.noise_factor)]
    if not clear:
        best = order[0]
        others = [k for k in order if k != baseline]
        lead = lighter_lead(space, baseline, comparisons, config) if final else None
        if lead is not None:
            rest = [k for k in order if k != lead]
            return lead, (
                f"lighter than the static plan and faster on the mean, though not clearly "
                f"({comparisons[lead].describe()}): under doubt the lighter setting is kept"
            ), rest[0]
        if best == baseline or effects[best] > -tie:
            return baseline, "the static plan is as fast as the fastest finalist (paired rounds)", (
                others[0] if others else None
            )
        return baseline, (
            f"best finalist {space.describe(space.setting(best))} is not clearly faster than the static plan "
            f"({comparisons[best].describe()}; a switch needs a ratio under {1.0 - config.min_gain:.3f} and a "
            f"permutation p-value under {1.0 - NormalDist().cdf(config.noise_factor):.3f}, so "
            f"{MIN_DECIDING_ROUNDS}+ rounds)"
        ), (others[0] if others else None)
    best_effect = min(effects[k] for k in clear)
    tied = [k for k in clear if effects[k] <= best_effect + tie]
    winner = min(tied, key=lambda k: space.preference(space.setting(k)))
    others = [k for k in order if k not in (winner, baseline)]
    return winner, f"clearly faster than the static plan: {comparisons[winner].describe()}", (
        others[0] if others else baseline
    )


def lighter_lead(
    space: SearchSpace, baseline: Key, comparisons: dict[Key, PairedComparison], config: AutotuneConfig
) -> Key | None:
    """The arm that replaces the static plan when no arm is clearly faster and the budget is spent:
    of the arms the space prefers to the plan (:meth:`SearchSpace.preference`, knobs in order:
    fewer threads first) that were measured in :data:`LEAN_ROUNDS` or more paired rounds and ran
    faster on the mean by more than ``min_gain``, the fastest; None when there is none.

    Why the lighter side. Being wrong costs the two sides differently on a host other work
    shares: a setting with more threads than the cores left free is preempted in every barrier of
    its thread team and can be many times slower (stock AdamW at 2 threads beside two 2-thread
    torch loops on a 2-core VM: 5.4x the mean step time of 1 thread, pooled over 30 sessions,
    ``bench.tuner_load --load threads``), while a lighter setting costs at most what its paired
    rounds could not rule out. There the load switches between two regimes every few seconds: in
    one, 2 threads run 110-140 ms a step and 1 thread 10-20 ms; in the other both run 12-60 ms.
    A session that probes in the second ends undecided after 10-11 rounds, leaning 0.85-0.9
    towards 1 thread, and kept the plan's 2 threads at 1.9-8.3x the best scored right after (5 of
    30 sessions). Only the direction the space prefers breaks such a tie: an undecided heavier arm
    never replaces the plan.
    """
    margin = gain_margin(config.min_gain)
    plan_rank = space.preference(space.setting(baseline))
    leaning = [k for k, c in comparisons.items()
               if c.n >= LEAN_ROUNDS and -c.effect > margin
               and space.preference(space.setting(k)) < plan_rank]
    return min(leaning, key=lambda k: (comparisons[k].effect, space.preference(space.setting(k))), default=None)
