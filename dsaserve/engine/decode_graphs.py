"""Decode CUDA graphs in page-table width classes (startup chain: "capture CUDA graphs"; every decode step after).

Owns: `DecodeGraphs`, one decode graph runner (`cuda_graph_runner.CudaGraphRunner`, a graph a batch bucket) for
each page-table width class, and which class a batch replays: the narrowest whose width holds the batch's page
table. `width_classes` says which widths a model gets.

Why: a graph fixes its kernels' choices for the static width of the page table it was captured with (the
indexer's path, `kernels/variants.selection_class`), and the staging copy moves the whole width. One set captured
for max_model_len runs a batch of short requests through the long-row selection: the score kernel, the split
select's launches and their workspace fills, over rows that take every key anyway, and copies a page table
max_model_len wide. H200, glm-5.3-slice, batch 128 at a 1K context (bench/RESULTS.md, twenty-sixth session): ~200 µs
of those kernels and a 2.1 MB copy; the step 3.40 ms from graphs captured for 128K against 3.30 from graphs
captured for 1K. The narrow class is the top-k's width: a batch whose every request holds at most `index_topk`
keys takes every visible key without a score (`indexer_topk`'s all-visible path) and without indexer queries
(`StepContext.all_keys`: no wq_b, RoPE or weights_proj; 63 µs of a b128 1K step, twenty-eighth session).
Few-row classes (`few_row_widths`): batches of 1-2 rows (`variants.FEW_ROWS`) also get graphs at the bounds where
one row's fused score + select keeps all its programs (32K and 64K keys, `variants.fused_select_widths`). At
max_model_len's width a 32K-key request's selection takes 2048-key chunks over 16 programs, the score kernel and the
select's launch apart (the fused launch stops at 64K keys); at the 64K class 512-key chunks over 64 programs in one
launch (two rows: the fused launch at the 32K class, 2048-key chunks at the 64K one where the widest gives 4096;
not timed). H100, glm-5.3-slice at max_model_len 128K, batch 1 at 32K (bench/RESULTS.md, forty-third session;
`profile_decode --ab default,wide_graphs`, one process): 1.993-1.996 ms overlapped against 2.023-2.026 replaying
the widest class. Larger batches keep the full classes: their selection is not the cooperative launch
(`triton_indexer_coop.COOP_ROWS`), and the score kernel's work follows the rows' positions, not the class's width: it
shares each row's own key tiles among the row's programs and leaves the keys past its position unwritten
(`triton_indexer_paged.row_run`, `fill=False`). H100, glm-5.3-slice, 128 rows at 32K: a full layer's selection 542
µs under a 128K-wide table before, 298 after, 304 at the rows' own width (bench/RESULTS.md, forty-fifth session).
The classes share one memory pool (the widest, captured first, sizes it) and one logits buffer (every graph's
lm_head writes into it: `CudaGraphRunner.logits_out`); the replay contract is one runner's: a replay's logits are
valid until the next replay of any class (or of the MTP graphs, engine/mtp_graphs.py, which share both).
"""

from __future__ import annotations

from collections.abc import Callable

from dsaserve.engine.cuda_graph_runner import CudaGraphRunner
from dsaserve.kernels.variants import FEW_ROWS, fused_select_widths
from dsaserve.model.forward_batch import ForwardBatch


def width_classes(max_pages: int, index_topk: int | None, page_size: int, narrow: bool) -> list[int]:
    """Page-table widths (pages) to capture decode graphs at, widest last: max_pages, and with `narrow` the top-k's
    width (index_topk // page_size pages) where it is narrower. DP-attention's gather graphs pass narrow=False:
    every rank replays the same graph, its collectives paired across ranks."""
    widths = {max_pages}
    if narrow and index_topk and 0 < index_topk // page_size < max_pages:
        widths.add(index_topk // page_size)
    return sorted(widths)


def few_row_widths(max_pages: int, index_topk: int | None, page_size: int, narrow: bool) -> list[int]:
    """Page-table widths (pages) of the few-row classes: `variants.fused_select_widths` strictly between the top-k's
    width (index_topk // page_size pages) and max_pages; none where narrow is off (DP-attention's gather graphs,
    switched off) or the model has no indexer."""
    if not narrow or not index_topk:
        return []
    low = index_topk // page_size
    return sorted({w // page_size for w in fused_select_widths() if low < w // page_size < max_pages})


class DecodeGraphs:
    """The runners of each width class behind `CudaGraphRunner`'s interface (capture, fallback_reason, replay and
    the manifest's fields; those of one bucket set are the widest runner's). `few_widths`: classes captured for
    batches of at most `few_rows` rows only (`few_row_widths`)."""

    def __init__(self, make_runner: Callable[..., CudaGraphRunner], widths: list[int],
                 few_widths: list[int] = (), few_rows: int = FEW_ROWS):
        self.runners = {w: make_runner(w) for w in sorted(widths)}
        self.widest = self.runners[max(self.runners)]
        self.max_bs, self.buckets = self.widest.max_bs, self.widest.buckets
        few_rows = min(few_rows, self.max_bs)
        self.few = {w: make_runner(w, few_rows) for w in sorted(set(few_widths) - set(widths))}
        # every class narrowest first, made once: `runner_for` runs on each step's host path
        self._classes = sorted([*self.runners.items(), *self.few.items()], key=lambda wr: wr[0])

    @property
    def widths(self) -> list[int]:
        """The classes every bucket has (the manifest's `page_table_widths`, the MTP graphs' and the ledger's)."""
        return sorted(self.runners)

    @property
    def few_row_widths(self) -> list[int]:
        return sorted(self.few)

    @property
    def few_row_max_bs(self) -> int:
        return max((r.max_bs for r in self.few.values()), default=0)

    def _all(self) -> list[CudaGraphRunner]:
        return [*self.runners.values(), *self.few.values()]

    @property
    def graphs(self) -> dict:
        return self.widest.graphs

    @property
    def copy_in_graph(self) -> bool:
        return self.widest.copy_in_graph

    @property
    def mirrored_widths(self) -> list[int]:
        """The classes whose page table stays on the device, changed by the steps' staged changes
        (engine/page_table_mirror.py); the others copy theirs whole each step."""
        return sorted(w for w, r in [*self.runners.items(), *self.few.items()] if r.mirror is not None)

    @property
    def capture_seconds(self) -> float:
        return sum(r.capture_seconds for r in self._all())

    @property
    def capture_retries(self) -> int:
        return sum(r.capture_retries for r in self._all())

    def capture(self, warm_each: bool = True) -> list[int]:
        """Every class's buckets, the widest first: the narrower ones capture into its memory pool, each warming
        only its largest bucket eagerly (`CudaGraphRunner.capture(warm_each=False)`: a capture that fails without
        a warm run is retried after one), since the widest class's warm runs did the step's other first-use work
        (H200, glm-5.3-slice: the narrow class warmed bucket by bucket added 9 s to a cold start's capture)."""
        buckets = self.widest.capture(warm_each)
        for runner in [*(self.runners[w] for w in reversed(self.widths[:-1])), *self.few.values()]:
            runner.pool_handle = self.widest.pool_handle
            runner.logits_out = self.widest.logits_out
            runner.capture(warm_each=False)
        return buckets

    def runner_for(self, batch: ForwardBatch, bucket: int | None = None) -> CudaGraphRunner:
        """The narrowest class whose width holds the batch's page table, a few-row class only for a batch of (and a
        `bucket`, where given, within) its rows (the widest if none holds it: its fallback says why)."""
        rows, width = batch.page_table.shape
        rows = max(rows, bucket or 0)
        return next((r for w, r in self._classes if w >= width and rows <= r.max_bs), self.widest)

    def fallback_reason(self, batch: ForwardBatch, bucket: int | None = None) -> str | None:
        return self.runner_for(batch, bucket).fallback_reason(batch, bucket)

    def replay(self, batch: ForwardBatch, bucket: int | None = None):
        return self.runner_for(batch, bucket).replay(batch, bucket)

    def replay_with_hidden(self, batch: ForwardBatch, bucket: int | None = None):
        return self.runner_for(batch, bucket).replay_with_hidden(batch, bucket)
