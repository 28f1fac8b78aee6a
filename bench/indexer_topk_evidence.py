"""How far an indexer top-k selection is from the exact one (issue 17): the evidence that tells near-ties at
the k-th score from selection bugs, for bench/sweep_indexer_prefill.py.

Owns: `row_evidence` (one row against its float64 scores and, when given, the kernel's own fp32 scores) and
`summarize` (a method's rows -> rates and worst cases).
Why these numbers: Hopper's FP8 MMA accumulates with reduced precision, so a kernel's score of a key is off
from the float64 one by up to some err; two keys whose float64 scores are closer than ~2 err may swap at
the k-th place legitimately. A mismatching row is a near-tie when
  gap = s64(best key left out) - s64(worst key taken)   is <= 2 err   (gap_over_err <= 2),
and its ranks sit at k (the best left-out key ranks just below k, the worst taken key just above). A bug
leaves out keys ranked far above k or takes keys ranked far below it, with gap >> err. `own_exact` checks the
selection against the exact top-k of the kernel's own fp32 scores: a correct select is exact there (ties at
the k-th aside), whatever the score precision.
"""

from __future__ import annotations

import torch


def position_ordered_topk(row: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k largest of row (every key above the k-th, then ties in position order), sorted."""
    kth = row.topk(k).values[-1]
    above = (row > kth).nonzero().squeeze(1)
    ties = (row == kth).nonzero().squeeze(1)[: k - len(above)]
    return torch.sort(torch.cat([above, ties])).values


def row_evidence(taken: torch.Tensor, s64: torch.Tensor, k: int, own: torch.Tensor | None = None,
                 own_is_the_kernels: bool = True) -> dict:
    """taken: the selected positions (0..len(s64)-1) of one row that sees more than k keys; s64: float64
    scores of the visible keys; own: fp32 scores of the same keys from an FP8 MMA (optional): the kernel's
    own, or (own_is_the_kernels False: only err is taken from them) another FP8 kernel's.
    -> exact (== float64 top-k), swapped (keys of the float64 top-k left out), worst_missing_rank /
    worst_extra_rank (0-based float64 ranks of the best key left out / the worst key taken: k-1 / k at a
    near-tie), gap_rel (gap over max |s64|), err_rel (max |own - s64| over max |s64|), gap_over_err,
    own_exact (== top-k of own)."""
    n = s64.numel()
    order = s64.argsort(descending=True)
    rank = torch.empty(n, dtype=torch.int64, device=s64.device)
    rank[order] = torch.arange(n, device=s64.device)
    sel = torch.zeros(n, dtype=torch.bool, device=s64.device)
    sel[taken] = True
    want = rank < k
    missing, extra = want & ~sel, sel & ~want
    scale = float(s64.abs().max()) or 1.0
    out = {"exact": not bool(missing.any()) and int(sel.sum()) == k, "swapped": int(missing.sum()),
           "worst_missing_rank": int(rank[missing].min()) if missing.any() else None,
           "worst_extra_rank": int(rank[extra].max()) if extra.any() else None, "gap_rel": 0.0,
           "err_rel": None, "gap_over_err": None, "own_exact": None}
    if missing.any() and sel.any():
        out["gap_rel"] = float(s64[missing].max() - s64[sel].min()) / scale
    if own is not None:
        err = float((own.double() - s64).abs().max()) / scale
        out["err_rel"] = err
        out["gap_over_err"] = out["gap_rel"] / err if err > 0 else (0.0 if out["gap_rel"] == 0 else float("inf"))
        if not own_is_the_kernels:
            return out
        want_own = torch.zeros(n, dtype=torch.bool, device=s64.device)
        want_own[position_ordered_topk(own.float(), k)] = True
        out["own_exact"] = bool((want_own == sel).all())
    return out


def summarize(rows: list[dict]) -> dict:
    """A method's sampled rows -> exact rate, own-scores exact rate, and the worst mismatch: the largest
    gap over the kernel's error, the best float64 rank left out and the worst rank taken."""
    n = max(len(rows), 1)
    bad = [r for r in rows if not r["exact"]]
    own = [r["own_exact"] for r in rows if r["own_exact"] is not None]
    ratios = [r["gap_over_err"] for r in bad if r["gap_over_err"] is not None]
    return {"rows": len(rows), "exact_rate": sum(r["exact"] for r in rows) / n,
            "own_exact_rate": sum(own) / len(own) if own else None,
            "max_swapped": max((r["swapped"] for r in bad), default=0),
            "max_gap_rel": max((r["gap_rel"] for r in bad), default=0.0),
            "max_gap_over_err": max(ratios, default=None),
            "min_missing_rank": min((r["worst_missing_rank"] for r in bad), default=None),
            "max_extra_rank": max((r["worst_extra_rank"] for r in bad), default=None)}


def verdict(summary: dict) -> str:
    """One word for the table: exact; near-ties (every mismatch's gap within 2 err); SUSPECT (a gap past
    2 err, or no err to judge by); SUSPECT(own) (not the exact top-k of the kernel's own scores)."""
    if summary["own_exact_rate"] not in (None, 1.0):
        return "SUSPECT(own)"
    if summary["exact_rate"] == 1.0:
        return "exact"
    ratio = summary["max_gap_over_err"]
    return "near-ties" if ratio is not None and ratio <= 2.0 else "SUSPECT"
