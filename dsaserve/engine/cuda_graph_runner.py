"""CUDA-graph decode runner (startup chain: "warmup" then "capture CUDA graphs"; every decode step after).

Owns: one graph per decode batch bucket up to `cuda_graph_max_bs`, the static input buffers the graphs read
(input_ids, positions, req_index, seq_lens, page_table, out_cache_loc), padding a batch up to its bucket,
and the counters a replay cannot bump from Python (`graph_replays`, and the step's byte terms).

Why the whole decode step fits in one graph (no piecewise split): the indexer's top-k runs on a static
[bs, max_context] score buffer masked by each token's position, and slot translation reads the static
page table on the device — no host sync, no data-dependent shapes. Padded rows write their KV into a
reserved sink page that no request owns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from dsaserve.engine.counters import COUNTERS, Counters
from dsaserve.ledger.causal import keys_scored, topk_selected
from dsaserve.model.forward_batch import ForwardBatch


def decode_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16 (SGLang's shape of bucket list)."""
    out = [b for b in (1, 2, 4) if b < max_bs]
    b = 8
    while b < max_bs:
        out.append(b)
        b += 8 if b < 64 else 16
    return sorted(set(out + [max_bs]))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    static_counts: dict[str, float]  # counters one eager run of this bucket bumped that do not depend on
    # the batch's contents (weight bytes, collective calls/bytes); each replay adds them again


class CudaGraphRunner:
    def __init__(self, model, pool, max_bs: int, max_pages_per_req: int, sink_page: int):
        self.model, self.pool, self.page_size = model, pool, pool.page_size
        self.max_bs, self.max_pages, self.sink_page = max_bs, max_pages_per_req, sink_page
        self.buckets = decode_buckets(max_bs)
        dev = pool.kv_buffer.device
        z = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=dev)  # noqa: E731
        self.input_ids, self.positions, self.req_index = z(max_bs), z(max_bs), z(max_bs)
        self.seq_lens, self.extend_lens, self.out_cache_loc = z(max_bs), torch.ones_like(z(max_bs)), z(max_bs)
        self.page_table = torch.full((max_bs, max_pages_per_req), sink_page, dtype=torch.int64, device=dev)
        self.graphs: dict[int, _Graph] = {}
        self.pool_handle = None
        self.capture_seconds = 0.0

    def _static_batch(self, bs: int) -> ForwardBatch:
        ones = [1] * bs
        return ForwardBatch(self.input_ids[:bs], self.positions[:bs], self.req_index[:bs], self.seq_lens[:bs],
                            self.extend_lens[:bs], self.page_table[:bs], self.out_cache_loc[:bs],
                            torch.arange(bs, device=self.input_ids.device), self.page_size, ones, ones)

    def _reset_padding(self, start: int, end: int | None = None) -> None:
        """Rows [start, end) become padding: position 0 of their own dummy request, KV to the sink page."""
        end = self.max_bs if end is None else end
        if start >= end:
            return
        self.input_ids[start:end].zero_()
        self.positions[start:end].zero_()
        self.seq_lens[start:end].fill_(1)
        self.req_index[start:end] = torch.arange(start, end, device=self.req_index.device)
        self.page_table[start:end].fill_(self.sink_page)
        self.out_cache_loc[start:end].fill_(self.sink_page * self.page_size)

    def capture(self) -> list[int]:
        """Warm each bucket eagerly (compiles kernels, records its weight bytes), then capture; largest first
        so smaller graphs reuse the largest one's memory pool."""
        t0 = time.perf_counter()
        self._reset_padding(0)
        for bs in sorted(self.buckets, reverse=True):
            before = COUNTERS.host_values()  # device-side counters replay inside the graph by themselves
            self.model(self._static_batch(bs), self.pool)  # warmup: the same shapes the graph will see
            static = {k: v for k, v in Counters.diff(COUNTERS.host_values(), before).items()
                      if k == "weight_bytes_read" or k.startswith("collective_")}
            COUNTERS.restore(before)  # startup work is not traffic
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            enabled, COUNTERS.enabled = COUNTERS.enabled, False  # capture-time Python must not count
            try:
                with torch.cuda.graph(graph, pool=self.pool_handle):
                    logits, _ = self.model(self._static_batch(bs), self.pool)
            finally:
                COUNTERS.enabled = enabled
            if self.pool_handle is None:
                self.pool_handle = graph.pool()
            self.graphs[bs] = _Graph(graph, logits, static)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        return sorted(self.graphs)

    def fallback_reason(self, batch: ForwardBatch) -> str | None:
        """None if this batch can replay a graph, else why it runs eager (counted by reason)."""
        if not self.graphs:
            return "no_graphs"
        seq_lens, ext = batch.host_lens()
        if all(n != 1 for n in ext):
            return "prefill"  # prefill is eager by design; not counted as a fallback
        if any(n != 1 for n in ext):
            return "mixed_prefill_decode"
        if len(ext) > self.max_bs:
            return "batch_over_max_bs"
        if batch.page_table.shape[1] > self.max_pages:
            return "context_over_capture"
        return None

    def replay(self, batch: ForwardBatch) -> torch.Tensor:
        bs = batch.batch_size
        bucket = next(b for b in self.buckets if b >= bs)
        self._reset_padding(bs, bucket)  # only this bucket's padding rows are read (none when bs == bucket)
        self.input_ids[:bs].copy_(batch.input_ids, non_blocking=True)
        self.positions[:bs].copy_(batch.positions, non_blocking=True)
        self.req_index[:bs].copy_(batch.req_index, non_blocking=True)
        self.seq_lens[:bs].copy_(batch.seq_lens, non_blocking=True)
        self.out_cache_loc[:bs].copy_(batch.out_cache_loc, non_blocking=True)
        width = batch.page_table.shape[1]
        self.page_table[:bs, :width].copy_(batch.page_table, non_blocking=True)
        g = self.graphs[bucket]
        g.graph.replay()
        self._count(batch, g)
        # a 1-token row may be a prefill chunk that is not its prompt's end: only logits_indices rows sample
        return g.logits.index_select(0, batch.logits_indices)

    def _count(self, batch: ForwardBatch, g: _Graph) -> None:
        """What the eager forward would have counted: bytes from host metadata, weights from warmup."""
        cfg, pool = self.model.cfg, self.pool
        seq_lens, _ = batch.host_lens()
        n_kv, n_full = cfg.num_hidden_layers, sum(cfg.is_full_indexer(i) for i in range(cfg.num_hidden_layers))
        bs = len(seq_lens)
        COUNTERS.add("graph_replays")
        COUNTERS.add("forward_steps")
        for k, v in g.static_counts.items():
            COUNTERS.add(k, v)
        COUNTERS.add("kv_bytes_written", bs * pool.kv_bpt * n_kv)
        COUNTERS.add("kv_bytes_read", sum(topk_selected(s - 1, 1, cfg.index_topk) for s in seq_lens)
                     * pool.kv_bpt * n_kv)
        COUNTERS.add("indexer_bytes_written", bs * pool.idx_bpt * n_full)
        COUNTERS.add("indexer_bytes_read", sum(keys_scored(s - 1, 1) for s in seq_lens) * pool.idx_bpt * n_full)
