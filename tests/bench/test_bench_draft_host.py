"""bench/bench_draft_host.py's no-op runner keeps up with what a drafting EngineCore asks of a runner, and its two
acceptance settings do what they say: every draft kept, or none (so both bookkeeping paths are what it times)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def _bench_module():
    path = Path(__file__).resolve().parents[2] / "bench" / "bench_draft_host.py"
    spec = importlib.util.spec_from_file_location("bench_draft_host", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_no_op_runner_keeps_every_draft_or_none():
    B = _bench_module()
    threads = torch.get_num_threads()
    try:
        for accept, kept in ((True, 2 * 3), (False, 0)):  # 2 requests x 3 drafts a step, or nothing
            r = B.bench(2, 3, accept, n=4, profile=False)
            assert r["kept_per_step"] == kept
            assert r["step"] > 0 and r["mtp_host"] > 0 and r["build"] > 0
    finally:
        torch.set_num_threads(threads)
