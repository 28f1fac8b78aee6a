"""Causal attention counts of a chunk: keys the indexer scores and slots sparse MLA reads; rows a prefill stages.

Owns: the closed forms both sides of the ledger use — its predictions (`ledger/prefill.py`,
`ledger/reconcile.py`, `ledger/marginal.py`) and the engine's measured counters (`model/step_counts.py`, eager
steps and graph replays alike), so prediction and measurement cannot drift apart by construction of the
arithmetic; and two rules by which the engine decides and both ledgers predict: the prefill staging's
(`model/layers/prefill_staging.py`) and the every-key rule (`takes_every_key`: a forward whose page table is within
the top-k scores no indexer key). Pure Python.
"""

from __future__ import annotations


def keys_scored(prefix: int, tokens: int) -> int:
    """Causal (query, key) pairs of `tokens` queries after `prefix` cached tokens: sum_{p} (p + 1)."""
    return tokens * prefix + tokens * (tokens + 1) // 2


def table_pages(seq_lens: list[int], page_size: int) -> int:
    """The page-table width (pages) of a batch built for these lengths: its longest request's pages
    (`engine/batch.py`, `contiguous_batch`)."""
    return -(-max(seq_lens, default=0) // page_size)


def takes_every_key(pages: int, page_size: int, index_topk: int) -> bool:
    """A forward whose page table is `pages` wide holds at most index_topk keys a row, so every full layer's top-k is
    every key its rows see, whatever the scores: the GPU selection scores none (`triton_indexer.take_all`), and a
    whole forward computes no indexer queries either (`StepContext.all_keys`)."""
    return 0 < pages * page_size <= index_topk


def keys_within_topk(keys: int, page_size: int, index_topk: int) -> bool:
    """`takes_every_key` of a request of `keys` keys alone (its page table as wide as its pages): the ledger's
    decode step and prefill chunk, which model one request's context."""
    return takes_every_key(-(-keys // page_size), page_size, index_topk)


def indexer_skips(pages: int, page_size: int, index_topk: int, segments: bool) -> tuple[bool, bool]:
    """(no indexer key is scored, no indexer query is made) in a forward at a page table `pages` wide: within the
    top-k the selection takes every key unscored, and a whole forward skips the queries too (`StepContext.all_keys`),
    where piecewise `segments` serve every width and make them. The engine's counters (`model/step_counts.py`) and
    the reconcile's prediction (`ledger/reconcile.py`) both take it."""
    every = takes_every_key(pages, page_size, index_topk)
    return every, every and not segments


def topk_selected(prefix: int, tokens: int, topk: int) -> int:
    """Sum over the chunk's queries of min(topk, p + 1) (slots sparse MLA reads)."""
    lo, hi = prefix + 1, prefix + tokens  # p + 1 ranges over lo..hi
    below = max(min(hi, topk) - lo + 1, 0)  # terms still under top-k: sum of lo..min(hi, topk)
    first = lo
    last = lo + below - 1
    s = (first + last) * below // 2 if below else 0
    return s + (tokens - below) * topk


STAGED_LAYOUT, STAGED_KV_LORA = "fp8_ds_mla", 512  # the only cache the staging reads (its GPU kernels' shape)
STAGING_MIN_TOKENS = 512  # model/layers/prefill_staging.py: a step of fewer tokens reads the fp8 cache itself
STAGING_ROWS_PER_TOKEN = 8  # ... and one whose requests' pages hold more rows than this per new token


def stages_latent(layout: str, kv_lora_rank: int) -> bool:
    """Whether prefills of this cache layout and latent width may be staged at all (`staged_rows` says which)."""
    return layout == STAGED_LAYOUT and kv_lora_rank == STAGED_KV_LORA


def staged_rows(seq_lens: list[int], tokens: int, page_size: int, min_tokens: int = STAGING_MIN_TOKENS,
                rows_per_token: int = STAGING_ROWS_PER_TOKEN) -> int:
    """Rows a step of `tokens` new tokens stages to bf16 in each layer (every request's pages up to its seq_len,
    whole pages), or 0 when the step reads the cache itself (too few tokens, or too many rows per token).

    Lengths only: what the ledger's planning model, its reconcile replay and the engine all know. The engine
    stages each distinct page once, so where requests share pages (prefix-cache hits) it stages fewer rows than
    this, never more: the decision is the same, and this count bounds the buffer (`reserve_bytes`)."""
    rows = sum(-(-s // page_size) for s in seq_lens) * page_size
    return rows if tokens >= min_tokens and 0 < rows <= rows_per_token * tokens else 0


def staged_row_bytes(kv_lora_rank: int, rope_dim: int) -> int:
    """One staged row: the latent (nope + rope) as bf16, what sparse MLA gathers from the staging (1152 B at
    512 + 64; the cache's fp8_ds_mla row is 656 B)."""
    return 2 * (kv_lora_rank + rope_dim)
