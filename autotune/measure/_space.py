"""Search spaces of named discrete knobs, and the ladders that build them.

A :class:`SearchSpace` is the cartesian product of a few :class:`Knob` s. It is frozen, compares
and hashes by value, and has a stable :meth:`SearchSpace.digest` so that ranks can check that they
tune the same space and caches can key on it. Knob values are JSON scalars (``int``, ``float``,
``str``, ``bool``), one type per knob, so a setting survives a JSON round trip unchanged and a
value of the wrong type (``"4"`` for ``4``, ``True`` for ``1``) is never mistaken for a member.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping, Sequence, Union

__all__ = ["Knob", "SearchSpace", "Setting", "geometric_ladder", "powers_of_two"]

Scalar = Union[int, float, str, bool]
#: One point of a space: knob name -> value. Tuners hand settings to clients as plain dicts.
Setting = Mapping[str, Scalar]

_SCALAR_TYPES = (bool, int, float, str)


def _type_name(value: object) -> str:
    return type(value).__name__


@dataclass(frozen=True, slots=True)
class Knob:
    """One named knob and the values it may take.

    Numeric values are kept sorted ascending; ``str`` and ``bool`` values keep the given order.
    ``prefer`` breaks ties between equally fast settings: ``"low"`` prefers values earlier in
    :attr:`values` (fewer threads), ``"high"`` prefers later ones (larger chunks).
    """

    name: str
    values: tuple[Scalar, ...]
    prefer: Literal["low", "high"] = "low"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"Knob name {self.name!r}: expected a non-empty str")
        if isinstance(self.values, (str, bytes)) or not isinstance(self.values, Iterable):
            raise ValueError(f"Knob {self.name!r}: values={self.values!r}: expected a sequence of scalars")
        values = tuple(self.values)
        if not values:
            raise ValueError(f"Knob {self.name!r}: expected at least one value, got none")
        kind = type(values[0])
        for value in values:
            if type(value) not in _SCALAR_TYPES:
                raise ValueError(
                    f"Knob {self.name!r}: value {value!r} of type {_type_name(value)}: "
                    "expected int, float, str or bool"
                )
            if type(value) is not kind:
                raise ValueError(
                    f"Knob {self.name!r}: value {value!r} is a {_type_name(value)} but the first "
                    f"value is a {kind.__name__}: expected one type per knob"
                )
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"Knob {self.name!r}: value {value!r}: expected a finite float")
        if len(set(values)) != len(values):
            raise ValueError(f"Knob {self.name!r}: values={values!r} contain duplicates")
        if kind in (int, float):
            values = tuple(sorted(values))
        object.__setattr__(self, "values", values)
        if self.prefer not in ("low", "high"):
            raise ValueError(f"Knob {self.name!r}: prefer={self.prefer!r}: expected 'low' or 'high'")

    def contains(self, value: object) -> bool:
        """True if ``value`` is one of :attr:`values`, with the same type."""
        return type(value) is type(self.values[0]) and value in self.values

    def rank_of(self, value: Scalar) -> int:
        """Tie-break rank of ``value``: smaller is preferred."""
        index = self.values.index(value)
        return index if self.prefer == "low" else len(self.values) - 1 - index


@dataclass(frozen=True, slots=True)
class SearchSpace:
    """Named discrete knobs; the candidates are their cartesian product.

    >>> space = SearchSpace((Knob("threads", (1, 2, 4)), Knob("chunk_numel", (1 << 20, 1 << 22), prefer="high")))
    >>> len(space), space.contains({"threads": 2, "chunk_numel": 1 << 20})
    (6, True)
    """

    knobs: tuple[Knob, ...]

    def __post_init__(self) -> None:
        if isinstance(self.knobs, Knob) or not isinstance(self.knobs, Iterable):
            raise ValueError(f"SearchSpace knobs={self.knobs!r}: expected a sequence of Knob")
        knobs = tuple(self.knobs)
        if not knobs:
            raise ValueError("SearchSpace: expected at least one knob, got none")
        for knob in knobs:
            if not isinstance(knob, Knob):
                raise ValueError(f"SearchSpace: {knob!r} is a {_type_name(knob)}: expected a Knob")
        names = [knob.name for knob in knobs]
        if len(set(names)) != len(names):
            raise ValueError(f"SearchSpace: knob names {names!r} contain duplicates")
        object.__setattr__(self, "knobs", knobs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SearchSpace:
        """Inverse of :meth:`to_dict`."""
        try:
            knobs = tuple(Knob(k["name"], tuple(k["values"]), k.get("prefer", "low")) for k in data["knobs"])
        except (KeyError, TypeError) as exc:
            raise ValueError(f"SearchSpace.from_dict: malformed data {data!r}: {exc}") from None
        return cls(knobs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(knob.name for knob in self.knobs)

    def __len__(self) -> int:
        return math.prod(len(knob.values) for knob in self.knobs)

    def candidates(self) -> list[dict[str, Scalar]]:
        """Every setting, in a fixed order (first knob varies slowest)."""
        return [dict(zip(self.names, values)) for values in itertools.product(*(k.values for k in self.knobs))]

    def why_not(self, setting: object) -> str | None:
        """None if ``setting`` is a member, else a sentence saying what is wrong with it."""
        if not isinstance(setting, Mapping):
            return f"{setting!r} is a {_type_name(setting)}, expected a dict of {list(self.names)}"
        if set(setting) != set(self.names):
            return f"{dict(setting)!r} has keys {sorted(map(str, setting))}, expected {sorted(self.names)}"
        for knob in self.knobs:
            value = setting[knob.name]
            if not knob.contains(value):
                return (
                    f"{knob.name}={value!r} ({_type_name(value)}) is not one of {list(knob.values)} "
                    f"({type(knob.values[0]).__name__})"
                )
        return None

    def contains(self, setting: object) -> bool:
        """True if ``setting`` has exactly this space's knobs, each set to one of its values (same type)."""
        return self.why_not(setting) is None

    def check(self, setting: object) -> dict[str, Scalar]:
        """Return ``setting`` as a plain dict in knob order; raise ValueError if it is not a member."""
        reason = self.why_not(setting)
        if reason is not None:
            raise ValueError(f"setting not in the search space: {reason}")
        assert isinstance(setting, Mapping)
        return {name: setting[name] for name in self.names}

    def key(self, setting: Setting) -> tuple[Scalar, ...]:
        """Hashable form of a member setting: its values in knob order."""
        return tuple(setting[name] for name in self.names)

    def setting(self, key: Sequence[Scalar]) -> dict[str, Scalar]:
        """Inverse of :meth:`key`."""
        return dict(zip(self.names, key))

    def lighter(self, setting: Setting) -> dict[str, Scalar] | None:
        """``setting`` with its first knob one value towards the preferred end, the other knobs kept;
        None when it is there already. The first knob is the one a loaded host punishes (threads:
        a team larger than the cores other work leaves free is preempted in its barriers), so
        this is the post-lock watch's challenger for a load that starts mid-run.

        >>> space = SearchSpace((Knob("threads", (1, 2, 4)), Knob("chunk_numel", (1 << 20, 1 << 22), prefer="high")))
        >>> space.lighter({"threads": 4, "chunk_numel": 1 << 22}), space.lighter({"threads": 1, "chunk_numel": 1 << 20})
        ({'threads': 2, 'chunk_numel': 4194304}, None)
        """
        knob = self.knobs[0]
        index = knob.values.index(setting[knob.name])
        index += -1 if knob.prefer == "low" else 1
        if not 0 <= index < len(knob.values):
            return None
        return {**self.check(setting), knob.name: knob.values[index]}

    def preference(self, setting: Setting) -> tuple[int, ...]:
        """Deterministic tie-break key: smaller is preferred, knobs compared in order."""
        return tuple(knob.rank_of(setting[knob.name]) for knob in self.knobs)

    def to_dict(self) -> dict[str, Any]:
        """JSON form: ``{"knobs": [{"name", "values", "prefer"}, ...]}``."""
        return {"knobs": [{"name": k.name, "values": list(k.values), "prefer": k.prefer} for k in self.knobs]}

    def digest(self) -> str:
        """Stable hex digest of :meth:`to_dict` (same on every process, run and machine)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def describe(self, setting: Setting) -> str:
        """``"threads=4 chunk_numel=4194304"``."""
        return " ".join(f"{name}={setting[name]}" for name in self.names)


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an int >= {minimum}")
    return value


def _thin(values: Sequence[int], keep: set[int], max_count: int) -> tuple[int, ...]:
    """Keep ``keep`` and fill up to ``max_count`` values with those that best spread out in log space."""
    chosen = sorted(set(keep))
    rest = [v for v in sorted(set(values)) if v not in keep]
    while len(chosen) < max_count and rest:
        # The value farthest (in log space) from every chosen one; ties go to the smaller value.
        best = max(rest, key=lambda v: (min(abs(math.log(v) - math.log(c)) for c in chosen), -v))
        chosen.append(best)
        rest.remove(best)
    return tuple(sorted(chosen))


def geometric_ladder(
    lo: int, hi: int, *, include: Iterable[int] = (), ratio: float = 2.0, max_count: int | None = None
) -> tuple[int, ...]:
    """Sorted integers ``lo, lo*ratio, lo*ratio**2, ... , hi``, plus every value of ``include``.

    ``lo``, ``hi`` and ``include`` are always kept; with ``max_count`` the intermediate rungs are
    thinned to the ones that spread out best in log space.

    >>> geometric_ladder(1, 30, include=(12,))
    (1, 2, 4, 8, 12, 16, 30)
    >>> geometric_ladder(1, 30, include=(12,), max_count=5)
    (1, 2, 4, 12, 30)
    """
    _check_int("lo", lo, 1)
    _check_int("hi", hi, lo)
    if not (isinstance(ratio, (int, float)) and not isinstance(ratio, bool) and ratio > 1 and math.isfinite(ratio)):
        raise ValueError(f"ratio={ratio!r}: expected a finite number > 1")
    extra = set()
    for value in include:
        _check_int("include value", value, 1)
        if not lo <= value <= hi:
            raise ValueError(f"include value {value!r} is outside [lo={lo}, hi={hi}]")
        extra.add(value)
    rungs = {lo, hi} | extra
    x = float(lo)
    while True:
        x *= ratio
        value = int(round(x))
        if value >= hi:
            break
        rungs.add(value)
    keep = {lo, hi} | extra
    if max_count is None:
        return tuple(sorted(rungs))
    _check_int("max_count", max_count, 1)
    if max_count < len(keep):
        raise ValueError(
            f"max_count={max_count} is smaller than the values that must be kept: {sorted(keep)}"
        )
    return _thin(sorted(rungs), keep, max_count)


def powers_of_two(lo: int, hi: int, *, max_count: int | None = None) -> tuple[int, ...]:
    """Sorted powers of two ``p`` with ``lo <= p <= hi`` (empty if there is none).

    With ``max_count`` the smallest and largest are kept and the others thinned evenly in log space
    (``max_count=1`` keeps only the largest).

    >>> powers_of_two(1 << 20, 3 << 22)
    (1048576, 2097152, 4194304, 8388608)
    >>> powers_of_two(1, 1 << 10, max_count=3)
    (1, 32, 1024)
    """
    _check_int("lo", lo, 1)
    _check_int("hi", hi, 1)
    if hi < lo:
        raise ValueError(f"hi={hi} is smaller than lo={lo}")
    first = 1 << (lo - 1).bit_length()
    values = []
    p = first
    while p <= hi:
        values.append(p)
        p <<= 1
    if max_count is None:
        return tuple(values)
    _check_int("max_count", max_count, 1)
    if len(values) <= max_count:
        return tuple(values)
    if max_count == 1:
        return (values[-1],)
    return _thin(values, {values[0], values[-1]}, max_count)
