"""``CacheEntry``: what the tuner locked in for one fingerprint, and its JSON form.

This module alone spells the entry's JSON form (:meth:`CacheEntry.to_json`,
:meth:`CacheEntry.from_json`; a cache test fails if another module spells a key)::

    {"winner": {...}, "baseline": {...}, "winner_median_s": float, "baseline_median_s": float,
     "measurements": [{"candidate": {...}, "samples": [float, ...]}, ...],
     "probe_steps": int, "created_unix": float, "fingerprint": {...}, "probe_cost_s": float,
     "runner_up": {...}, "paired_ratio": float}

``fingerprint``, ``probe_cost_s``, ``runner_up`` and ``paired_ratio`` are optional: entries of older versions lack them and still
load (the field is then None), and an entry without them is written without the key.

Values are checked for type only (knob dicts map str to a JSON scalar, ints fit in int64, floats
are finite, counts are non-negative ints, not bools): a bad entry is a cache miss, never a crash
(:class:`~autotune.TuningCache` warns and sets it aside). Whether a cached setting belongs to the search
space is :meth:`CacheEntry.why_unusable`'s question, asked by the tuner.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, cast

from autotune.measure._measurement import probe_cost_pct

if TYPE_CHECKING:
    from autotune.measure._space import SearchSpace

__all__ = ["CacheEntry", "CacheEntryError", "validate_entry"]

#: Integers outside int64 are rejected: no knob of a real machine needs more.
_INT_LIMIT = 1 << 63


class CacheEntryError(ValueError):
    """An entry passed to :meth:`TuningCache.put` does not have the documented structure."""


# --------------------------------------------------------------------------------------------
# Validation (types only; ranges are the tuner's job)


def _check_json_value(value: Any, where: str) -> None:
    """Raise CacheEntryError unless ``value`` is plain JSON with finite floats and int64 ints."""
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not -_INT_LIMIT <= value < _INT_LIMIT:
            raise CacheEntryError(f"{where}: a {len(str(abs(value)))}-digit integer is outside int64")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CacheEntryError(f"{where}: {value!r} is not a finite number")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_json_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, str):
                raise CacheEntryError(f"{where}: key {k!r} is not a string")
            _check_json_value(item, f"{where}.{k}")
        return
    raise CacheEntryError(f"{where}: {type(value).__name__} is not a JSON value")


def _check_knobs(value: Any, where: str) -> None:
    if not isinstance(value, dict) or not value:
        raise CacheEntryError(f"{where}={value!r}: expected a non-empty dict of knob name -> scalar")
    for name, knob in value.items():
        if not isinstance(name, str) or not name:
            raise CacheEntryError(f"{where}: knob name {name!r} is not a non-empty string")
        # The scalar types of autotune.SearchSpace. Whether the value (and its exact type: True
        # is not 1) belongs to the space is checked by the tuner, which knows the space.
        if not isinstance(knob, (int, float, str)):  # bool is an int
            raise CacheEntryError(f"{where}.{name}={knob!r}: expected an int, float, str or bool")


def _check_seconds(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CacheEntryError(f"{where}={value!r}: expected a number of seconds")
    if not math.isfinite(value) or value < 0:
        raise CacheEntryError(f"{where}={value!r}: expected a finite number >= 0")


def _check_entry(entry: Any) -> None:
    """Raise :class:`CacheEntryError` naming the first field of ``entry`` with a wrong type."""
    if not isinstance(entry, dict):
        raise CacheEntryError(f"entry={type(entry).__name__}: expected a dict")
    missing = [k for k in _REQUIRED_KEYS if k not in entry]
    if missing:
        raise CacheEntryError(f"entry is missing {missing}; expected keys {list(_REQUIRED_KEYS)}")
    _check_json_value(entry, "entry")
    _check_knobs(entry["winner"], "winner")
    _check_knobs(entry["baseline"], "baseline")
    _check_seconds(entry["winner_median_s"], "winner_median_s")
    _check_seconds(entry["baseline_median_s"], "baseline_median_s")
    _check_seconds(entry["created_unix"], "created_unix")
    steps = entry["probe_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise CacheEntryError(f"probe_steps={steps!r}: expected an int >= 0")
    measurements = entry["measurements"]
    if not isinstance(measurements, list):
        raise CacheEntryError(f"measurements={measurements!r}: expected a list")
    for i, m in enumerate(measurements):
        if not isinstance(m, dict) or "candidate" not in m or "samples" not in m:
            raise CacheEntryError(f"measurements[{i}]={m!r}: expected a dict with candidate and samples")
        _check_knobs(m["candidate"], f"measurements[{i}].candidate")
        samples = m["samples"]
        if not isinstance(samples, list):
            raise CacheEntryError(f"measurements[{i}].samples={samples!r}: expected a list of seconds")
        for j, s in enumerate(samples):
            _check_seconds(s, f"measurements[{i}].samples[{j}]")
    if "fingerprint" in entry and not isinstance(entry["fingerprint"], dict):
        raise CacheEntryError(f"fingerprint={entry['fingerprint']!r}: expected a dict")
    if "probe_cost_s" in entry:
        _check_seconds(entry["probe_cost_s"], "probe_cost_s")
    if "runner_up" in entry:
        _check_knobs(entry["runner_up"], "runner_up")
    if "paired_ratio" in entry:
        ratio = entry["paired_ratio"]
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not (math.isfinite(ratio) and ratio > 0):
            raise CacheEntryError(f"paired_ratio={ratio!r}: expected a finite ratio > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class CacheEntry:
    """What the tuner locked in for one fingerprint: one value of the file's ``entries``."""

    winner: dict[str, Any]
    """The setting locked in (knob name -> JSON scalar)."""
    baseline: dict[str, Any]
    """The static plan it was compared with."""
    winner_median_s: float
    """The winner's median step time when recorded (what a re-check compares with)."""
    baseline_median_s: float
    """The static plan's median step time when recorded."""
    measurements: tuple[dict[str, Any], ...]
    """Every measured candidate: ``{"candidate": setting, "samples": [seconds, ...]}``; other
    keys (a :class:`~autotune.decide._records.Decision`'s ``median_s``, ...) are not stored."""
    probe_steps: int
    """Probe steps the tuning session spent."""
    created_unix: float
    """When the entry was made (``time.time()``)."""
    fingerprint: dict[str, Any] | None = None
    """What the key was made of (machine, software, workload), for ``python -m autotune show``;
    None when not recorded (entries of older versions): the JSON form then has no such key."""
    probe_cost_s: float | None = None
    """Seconds the session's probe steps took beyond as many steps at the winner's median
    (:func:`autotune.measure._measurement.probe_cost_s`); None when not recorded (older versions, or a
    winner without a median): the JSON form then has no such key."""
    runner_up: dict[str, Any] | None = None
    """The setting the post-lock watch compared the winner with (the best other finalist, or the
    static plan); None when not recorded: the JSON form then has no such key."""
    paired_ratio: float | None = None
    """The winner's mean step time over the static plan's in the paired rounds that decided (what
    the lock-in reported); None when not recorded (no paired rounds, older versions)."""

    def to_json(self) -> dict[str, Any]:
        """The entry's JSON form (plain, deep-copied values)."""
        return {
            "winner": dict(self.winner),
            "baseline": dict(self.baseline),
            "winner_median_s": self.winner_median_s,
            "baseline_median_s": self.baseline_median_s,
            "measurements": [{"candidate": dict(m["candidate"]), "samples": list(m["samples"])}
                             for m in self.measurements],
            "probe_steps": self.probe_steps,
            "created_unix": self.created_unix,
            **({} if self.fingerprint is None else {"fingerprint": copy.deepcopy(dict(self.fingerprint))}),
            **({} if self.probe_cost_s is None else {"probe_cost_s": self.probe_cost_s}),
            **({} if self.runner_up is None else {"runner_up": dict(self.runner_up)}),
            **({} if self.paired_ratio is None else {"paired_ratio": self.paired_ratio}),
        }

    @classmethod
    def from_json(cls, value: object) -> CacheEntry:
        """The entry of a JSON value; raises :class:`CacheEntryError` naming the first bad field
        (types only: whether it suits a search space is :meth:`why_unusable`). Unknown keys are
        allowed (a later version may add some) and dropped."""
        _check_entry(value)  # raises CacheEntryError unless value is a dict with the entry's fields
        value = cast(dict, value)
        return cls(
            winner=dict(value["winner"]),
            baseline=dict(value["baseline"]),
            winner_median_s=value["winner_median_s"],
            baseline_median_s=value["baseline_median_s"],
            measurements=tuple(
                {"candidate": dict(m["candidate"]), "samples": list(m["samples"])} for m in value["measurements"]
            ),
            probe_steps=value["probe_steps"],
            created_unix=value["created_unix"],
            fingerprint=copy.deepcopy(value.get("fingerprint")),
            probe_cost_s=value.get("probe_cost_s"),
            runner_up=dict(value["runner_up"]) if "runner_up" in value else None,
            paired_ratio=value.get("paired_ratio"),
        )

    @property
    def speedup(self) -> float | None:
        """How much faster than the static plan the winner was: 1 / :attr:`paired_ratio` where
        recorded (as the lock-in said), else the static plan's median / the winner's; None unless
        a finite number."""
        if self.paired_ratio is not None and self.paired_ratio > 0:
            return 1.0 / self.paired_ratio
        if not self.winner_median_s > 0:
            return None
        value = self.baseline_median_s / self.winner_median_s
        return value if math.isfinite(value) else None

    @property
    def probe_cost_pct(self) -> float | None:
        """:attr:`probe_cost_s` as a percentage of 1000 steps at the winner's median (None when
        not recorded)."""
        return probe_cost_pct(self.probe_cost_s, self.winner_median_s)

    def export_row(self) -> dict[str, Any]:
        """The entry as a row of ``python -m autotune export --format csv`` (flattened there):
        its JSON form with ``speedup`` after the medians and ``candidates_measured`` (a count)
        in place of the measurements; ``probe_cost_s`` and ``fingerprint`` only when recorded."""
        row = {
            "created_unix": self.created_unix,
            "winner": dict(self.winner),
            "baseline": dict(self.baseline),
            "winner_median_s": self.winner_median_s,
            "baseline_median_s": self.baseline_median_s,
            "speedup": self.speedup,
            "probe_steps": self.probe_steps,
            "candidates_measured": len(self.measurements),
        }
        if self.probe_cost_s is not None:
            row["probe_cost_s"] = self.probe_cost_s
        if self.fingerprint is not None:
            row["fingerprint"] = copy.deepcopy(self.fingerprint)
        return row

    def why_unusable(self, space: SearchSpace) -> str | None:
        """None if the tuner of ``space`` may re-check this entry's winner, else why not."""
        reason = space.why_not(self.winner)
        if reason is not None:
            return f"cached winner: {reason}"
        for name in ("winner_median_s", "baseline_median_s"):
            value = getattr(self, name)
            if not value > 0:
                return f"cached {name}={value!r}: expected a finite number of seconds > 0"
        return None


#: Keys every entry's JSON form has (``fingerprint`` and ``probe_cost_s`` may be absent: files of
#: older versions).
_OPTIONAL_KEYS = ("fingerprint", "probe_cost_s", "runner_up", "paired_ratio")
_REQUIRED_KEYS = tuple(f.name for f in fields(CacheEntry) if f.name not in _OPTIONAL_KEYS)


def validate_entry(entry: Any) -> None:
    """Raise :class:`CacheEntryError` naming the first field of ``entry`` with a wrong type."""
    _check_entry(entry)
