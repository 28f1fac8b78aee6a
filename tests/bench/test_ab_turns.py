"""bench/ab_turns.py: ABBA turn order and the old / new summary (synthetic bench_gpu results, no GPU)."""

from __future__ import annotations

import pytest

from bench import ab_turns


def _run(*steps_ms, bound=1.0):
    return {"decode": [{"bs": 1, "ctx": c, "step_ms": ms, "roofline_ms": bound}
                       for c, ms in zip((1024, 32768), steps_ms, strict=True)]}


def test_turns_put_each_version_first_equally_often():
    assert ab_turns.order(2) == ["old", "new", "new", "old"]
    assert ab_turns.order(3)[:2] == ["old", "new"] and ab_turns.order(3)[4:] == ["old", "new"]


def test_summary_pairs_the_turns_and_cancels_a_drift():
    # the machine drifts +0.1 ms in the second round; new is 20 µs faster at 32K only
    runs = [("old", _run(1.6, 1.7)), ("new", _run(1.6, 1.68)), ("new", _run(1.7, 1.78)), ("old", _run(1.7, 1.8))]
    s = ab_turns.summary([(code, ab_turns.steps(r)) for code, r in runs])
    assert s["1x1024"]["new_minus_old_us"] == pytest.approx(0.0)
    assert s["1x32768"]["new_minus_old_us"] == pytest.approx(-20.0)
    assert s["1x32768"]["old_over_1024_us"] == pytest.approx([100.0, 100.0])
    assert s["1x32768"]["new_over_1024_us"] == pytest.approx([80.0, 80.0])


def test_a_failed_turn_leaves_the_others_paired():
    runs = [("old", ab_turns.steps(_run(1.6, 1.7))), ("new", {})]
    s = ab_turns.summary(runs)
    assert s["1x32768"]["new_minus_old_us"] is None and s["1x32768"]["new_ms"] == [None]


def test_each_step_is_divided_by_its_own_runs_bound():
    found = [("old", _run(1.6, 1.7, bound=1.2)), ("new", _run(1.5, 1.65, bound=1.1))]
    s = ab_turns.summary([(c, ab_turns.steps(r)) for c, r in found],
                         [ab_turns.steps(r, "roofline_ms") for _, r in found])
    assert s["1x32768"]["old_ratio"] == pytest.approx([1.7 / 1.2], abs=1e-3)
    assert s["1x32768"]["new_ratio"] == pytest.approx([1.65 / 1.1], abs=1e-3)


def test_a_run_without_a_bound_keeps_its_place_in_the_ratios():
    found = [("old", _run(1.6, 1.7, bound=1.2)), ("new", _run(1.5, 1.65, bound=1.1))]
    bounds = [ab_turns.steps(found[0][1], "roofline_ms"), {}]
    s = ab_turns.summary([(c, ab_turns.steps(r)) for c, r in found], bounds)
    assert s["1x32768"]["new_ratio"] == [None] and s["1x32768"]["old_ratio"] == pytest.approx([1.7 / 1.2], abs=1e-3)
