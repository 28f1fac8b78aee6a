"""`dsaserve bench step` runs the engine's own bench/bench_scheduler_step.py end to end (a few no-op steps):
the script's fake runner must keep up with what EngineCore asks of a runner."""

from __future__ import annotations

import torch

from dsaserve.cli import main


def test_bench_step_runs_the_real_script(set_switch, capsys):
    set_switch("DSASERVE_BENCH_STEP_SCRIPT", None)  # the shipped script, as a user runs it
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "step", "--steps", "2", "--batches", "1,2"])
    finally:
        torch.set_num_threads(threads)  # the script pins torch to one thread
    out = capsys.readouterr().out
    assert rc == 0
    assert "| batch | overlap | schedule µs" in out
    rows = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert [r.split("|")[1:3] for r in rows] == [[" 1 ", " off "], [" 1 ", " on "], [" 2 ", " off "], [" 2 ", " on "]]
