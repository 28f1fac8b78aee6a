"""bench/indexer_topk_evidence.py: the numbers that tell near-ties at the k-th score from selection bugs (the
GPU sweep that uses them runs on the device)."""

from __future__ import annotations

import torch

from bench import indexer_topk_evidence as E


def _row(n: int = 400, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_the_exact_top_k_is_exact_against_float64_and_own_scores():
    s64, k = _row(), 40
    taken = s64.topk(k).indices
    ev = E.row_evidence(taken, s64, k, own=s64.float())
    assert ev["exact"] and ev["own_exact"] and ev["swapped"] == 0 and ev["gap_rel"] == 0.0
    assert E.verdict(E.summarize([ev])) == "exact"


def test_a_swap_at_the_kth_place_within_the_score_error_is_a_near_tie():
    s64, k = _row(), 40
    order = s64.argsort(descending=True)
    taken = torch.cat([order[:k - 1], order[k:k + 1]])  # the k-th key left out, the (k+1)-th taken
    gap = float(s64[order[k - 1]] - s64[order[k]])
    own = s64.clone()
    own[order[k - 1]] -= gap  # the kernel's score of the k-th key came out just below the (k+1)-th's
    own[order[k]] += 0.1 * gap
    ev = E.row_evidence(taken, s64, k, own=own.float())
    assert not ev["exact"] and ev["swapped"] == 1
    assert (ev["worst_missing_rank"], ev["worst_extra_rank"]) == (k - 1, k)
    assert abs(ev["gap_rel"] - gap / float(s64.abs().max())) < 1e-12
    assert ev["own_exact"] and ev["gap_over_err"] <= 2.0
    assert E.verdict(E.summarize([ev])) == "near-ties"


def test_a_far_miss_is_suspect_and_a_wrong_own_selection_is_flagged():
    s64, k = _row(), 40
    order = s64.argsort(descending=True)
    taken = torch.cat([order[1:k], order[-1:]])  # the best key left out, the worst taken
    ev = E.row_evidence(taken, s64, k, own=(s64 + 1e-6).float())
    assert (ev["worst_missing_rank"], ev["worst_extra_rank"]) == (0, len(s64) - 1)
    assert not ev["own_exact"] and ev["gap_over_err"] > 100
    assert E.verdict(E.summarize([ev])) == "SUSPECT(own)"
    other = E.row_evidence(taken, s64, k, own=(s64 + 1e-6).float(), own_is_the_kernels=False)
    assert other["own_exact"] is None and E.verdict(E.summarize([other])) == "SUSPECT"


def test_summary_rates_over_rows():
    s64, k = _row(), 40
    order = s64.argsort(descending=True)
    good = E.row_evidence(order[:k], s64, k)
    bad = E.row_evidence(torch.cat([order[:k - 2], order[k:k + 2]]), s64, k)
    out = E.summarize([good, bad, good, good])
    assert out["exact_rate"] == 0.75 and out["max_swapped"] == 2 and out["own_exact_rate"] is None
    assert out["min_missing_rank"] == k - 2 and out["max_extra_rank"] == k + 1
