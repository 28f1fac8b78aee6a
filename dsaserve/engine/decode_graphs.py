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
The classes share one memory pool (the widest, captured first, sizes it) and one logits buffer (every graph's
lm_head writes into it: `CudaGraphRunner.logits_out`); the replay contract is one runner's: a replay's logits are
valid until the next replay of either class (or of the MTP graphs, engine/mtp_graphs.py, which share both).
"""

from __future__ import annotations

from collections.abc import Callable

from dsaserve.engine.cuda_graph_runner import CudaGraphRunner
from dsaserve.model.forward_batch import ForwardBatch


def width_classes(max_pages: int, index_topk: int | None, page_size: int, narrow: bool) -> list[int]:
    """Page-table widths (pages) to capture decode graphs at, widest last: max_pages, and with `narrow` the top-k's
    width (index_topk // page_size pages) where it is narrower. DP-attention's gather graphs pass narrow=False:
    every rank replays the same graph, its collectives paired across ranks."""
    widths = {max_pages}
    if narrow and index_topk and 0 < index_topk // page_size < max_pages:
        widths.add(index_topk // page_size)
    return sorted(widths)


class DecodeGraphs:
    """The runners of each width class behind `CudaGraphRunner`'s interface (capture, fallback_reason, replay and
    the manifest's fields; those of one bucket set are the widest runner's)."""

    def __init__(self, make_runner: Callable[[int], CudaGraphRunner], widths: list[int]):
        self.runners = {w: make_runner(w) for w in sorted(widths)}  # narrowest first (`runner_for` relies on it)
        self.widest = self.runners[max(self.runners)]
        self.max_bs, self.buckets = self.widest.max_bs, self.widest.buckets

    @property
    def widths(self) -> list[int]:
        return sorted(self.runners)

    @property
    def graphs(self) -> dict:
        return self.widest.graphs

    @property
    def copy_in_graph(self) -> bool:
        return self.widest.copy_in_graph

    @property
    def capture_seconds(self) -> float:
        return sum(r.capture_seconds for r in self.runners.values())

    @property
    def capture_retries(self) -> int:
        return sum(r.capture_retries for r in self.runners.values())

    def capture(self, warm_each: bool = True) -> list[int]:
        """Every class's buckets, the widest first: the narrower ones capture into its memory pool, each warming
        only its largest bucket eagerly (`CudaGraphRunner.capture(warm_each=False)`: a capture that fails without
        a warm run is retried after one), since the widest class's warm runs did the step's other first-use work
        (H200, glm-5.3-slice: the narrow class warmed bucket by bucket added 9 s to a cold start's capture)."""
        buckets = self.widest.capture(warm_each)
        for width in reversed(self.widths[:-1]):
            self.runners[width].pool_handle = self.widest.pool_handle
            self.runners[width].logits_out = self.widest.logits_out
            self.runners[width].capture(warm_each=False)
        return buckets

    def runner_for(self, batch: ForwardBatch) -> CudaGraphRunner:
        """The narrowest class whose width holds the batch's page table (the widest if none: its fallback says why)."""
        width = batch.page_table.shape[1]
        return next((r for w, r in self.runners.items() if w >= width), self.widest)  # narrowest first

    def fallback_reason(self, batch: ForwardBatch, bucket: int | None = None) -> str | None:
        return self.runner_for(batch).fallback_reason(batch, bucket)

    def replay(self, batch: ForwardBatch, bucket: int | None = None):
        return self.runner_for(batch).replay(batch, bucket)

    def replay_with_hidden(self, batch: ForwardBatch, bucket: int | None = None):
        return self.runner_for(batch).replay_with_hidden(batch, bucket)
