"""``bench.membus._harness``, the memory-bus benchmarks' timing loop, with fake variants that
return fixed times: the order of every round, the warm-up rounds dropped, a probe run last in each
round, several samples from one visit, and the per-round ratios."""

from __future__ import annotations

from bench.membus._harness import alternate, command, interleaved, paired, rotation, summary


def test_rounds_rotate_the_variants_and_drop_the_warm_up() -> None:
    visits: list[str] = []

    def variant(name: str, seconds: float):
        def call() -> float:
            visits.append(name)
            return seconds + len(visits)  # which visit made a sample
        return call

    samples = interleaved({"a": variant("a", 0.0), "b": variant("b", 0.0), "c": variant("c", 0.0)}, 3, warmup=1,
                          then=("probe", variant("probe", 0.0)))
    assert visits == ["a", "b", "c", "probe", "b", "c", "a", "probe", "c", "a", "b", "probe",
                      "a", "b", "c", "probe"]
    assert samples == {"a": [7.0, 10.0, 13.0], "b": [5.0, 11.0, 14.0], "c": [6.0, 9.0, 15.0],
                       "probe": [8.0, 12.0, 16.0]}


def test_a_visit_may_measure_several_steps_in_its_own_order() -> None:
    order = lambda r: [(v, t) for t in alternate([1, 2], r) for v in rotation(["x", "y"], r)]  # noqa: E731
    seen: list[tuple[str, int]] = []

    def visit(key: tuple[str, int]):
        return lambda: seen.append(key) or [1.0, 2.0]

    samples = interleaved({k: visit(k) for k in [("x", 1), ("y", 1), ("x", 2), ("y", 2)]}, 2, order=order)
    assert seen == [("x", 1), ("y", 1), ("x", 2), ("y", 2), ("y", 2), ("x", 2), ("y", 1), ("x", 1)]
    assert all(s == [1.0, 2.0, 1.0, 2.0] for s in samples.values())


def test_two_variants_alternate_and_ratios_are_per_round() -> None:
    assert [rotation(["plain", "follow"], r) for r in range(3)] == [["plain", "follow"], ["follow", "plain"],
                                                                  ["plain", "follow"]]
    r = paired([2.0, 4.0, 9.0], [1.0, 2.0, 3.0], scale=0.5)
    assert r["median"] == 1.0 and r["n"] == 3
    s = summary([1.0, 2.0, 3.0], bytes_moved=2_000_000_000)
    assert s["median_s"] == 2.0 and s["gbps"] == 1.0 and s["samples_s"] == [1.0, 2.0, 3.0] and s["n"] == 3
    assert command("fused_mp", ["--rounds", "3", "--note", "a b"]) == "python -m bench.membus.fused_mp --rounds 3 --note 'a b'"
