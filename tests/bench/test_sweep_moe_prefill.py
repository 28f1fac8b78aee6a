"""bench/sweep_moe_prefill.py without a GPU: its skewed routing leaves an expert empty, and one sweep pass at toy
shapes under the Triton interpreter checks a dense variant against the reference and survives a variant that
fails (the sweep goes on, the row says why)."""

from __future__ import annotations

import torch

from bench import sweep_moe_prefill as S
from tests.kernels.gpu_common import requires_gpu_kernels


def test_skewed_routing_leaves_expert_zero_empty_and_piles_onto_a_few():
    e, h, k = 8, 128, 2
    _, tw, ids = S.make_batch(256, e, h, k, "skewed", "cpu")
    counts = torch.bincount(ids.reshape(-1), minlength=e)
    assert counts[0] == 0 and counts.sum() == 256 * k
    assert counts.max() > 2 * 256 * k / e  # a hot expert: several times the mean
    assert (ids[:, 0] != ids[:, 1]).all()  # top-k picks distinct experts


@requires_gpu_kernels
def test_one_sweep_pass_at_toy_shapes_checks_each_variant(monkeypatch):
    from tests.kernels.gpu_common import DEVICE

    monkeypatch.setitem(S.CONFIGS, "broken", {"kernel": "dense", "bn1": 48})  # not a legal tile: must fail alone
    rows = S.sweep(["d128 promote (default)", "broken"], [20], ["skewed"], S.SHAPE["tiny"], DEVICE, 1,
                   float("nan"))
    good, bad = rows
    assert good["ok"] and good["rel_err"] < S.FP8A
    assert "error" in bad and bad["variant"] == "broken"


@requires_gpu_kernels
def test_stage_breakdown_runs_every_stage_at_toy_shapes():
    from tests.kernels.gpu_common import DEVICE

    stages = S.stage_breakdown("d128 pair2 mma_acc2", S.SHAPE["tiny"], 24, 1, float("nan"), DEVICE)
    assert [r["stage"] for r in stages] == ["align torch (old)", "align triton", "permute token", "permute slot",
                                            "gemm1", "gemm2", "combine", "whole"]
    by = {r["stage"]: r for r in stages}
    assert by["permute token"]["bytes"] < by["permute slot"]["bytes"]  # x read once, no padding rows written
    assert by["gemm1"]["bytes"] == 0 and "HBM floor" in S.stage_text(by["permute token"])


def test_overall_best_skips_a_variant_wrong_anywhere():
    rows = [{"variant": "a", "config": {"kernel": "dense"}, "us": 1.0, "ok": False},
            {"variant": "a", "config": {"kernel": "dense"}, "us": 1.0, "ok": True},
            {"variant": "b", "config": {"kernel": "dense"}, "us": 5.0, "ok": True},
            {"variant": "g", "config": {"kernel": "gemm"}, "us": 0.5, "ok": True}]
    assert S.overall_best(rows) == "b"
