"""Causal attention counts of a chunk: keys the indexer scores and slots sparse MLA reads.

Owns: the two closed forms both sides of the ledger use — its predictions (`ledger/prefill.py`,
`ledger/reconcile.py`) and the engine's measured counters (`model/step_counts.py`, eager steps and graph
replays alike), so prediction and measurement cannot drift apart by construction of the arithmetic. Pure Python.
"""

from __future__ import annotations


def keys_scored(prefix: int, tokens: int) -> int:
    """Causal (query, key) pairs of `tokens` queries after `prefix` cached tokens: sum_{p} (p + 1)."""
    return tokens * prefix + tokens * (tokens + 1) // 2


def topk_selected(prefix: int, tokens: int, topk: int) -> int:
    """Sum over the chunk's queries of min(topk, p + 1) (slots sparse MLA reads)."""
    lo, hi = prefix + 1, prefix + tokens  # p + 1 ranges over lo..hi
    below = max(min(hi, topk) - lo + 1, 0)  # terms still under top-k: sum of lo..min(hi, topk)
    first = lo
    last = lo + below - 1
    s = (first + last) * below // 2 if below else 0
    return s + (tokens - below) * topk
