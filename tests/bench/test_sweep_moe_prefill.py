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
    rows = S.sweep(["d128 bn128/128 w8 s3/4", "broken"], [20], ["skewed"], S.SHAPE["tiny"], DEVICE, 1,
                   float("nan"))
    good, bad = rows
    assert good["ok"] and good["rel_err"] < S.FP8A
    assert "error" in bad and bad["variant"] == "broken"
