"""CUDA graphs of the MTP layer's forward (speculative decoding, engine/mtp.py; startup chain: "capture CUDA
graphs", after the decode graphs).

Owns: `MTPGraphRunner`, the decode graph runner (engine/cuda_graph_runner.py) whose graphs run the MTP layer
(`DsaForCausalLM.forward_mtp`) in place of the main model, over one token a row (`forward_batch.one_token_rows`),
with the hidden rows the layer reads (the main model's, or its own output for a chained draft) as one more static
input and a chained draft's token ids resolved on the device (placeholders); and `capture_mtp_graphs`,
a runner a page-table width class (engine/decode_graphs.py) in the decode graphs' memory pool.

Why: eagerly, one MTP forward is one decoder layer, the shared head and the lm_head launched from Python, tens of
kernels at ~10-80 µs of host time each: on the H200 a drafting step of glm-5.3-mini took 5.7x the plain step's
time (bench/RESULTS.md, thirty-fourth and thirty-fifth sessions), where its verify step is one decode-graph replay.
Every MTP forward of a step fits one token a row: the chained drafts are one token a request, and the extend's
positions (a request's kept tokens, or a short prompt's) attend their request's keys up to their own position as
decode rows do (`one_token_rows`); a batch over the largest bucket (a long prompt's extend) runs eagerly. The
graphs compute logits at every row; the drafts' rows are selected after the replay. Under DP-attention the MTP
forwards stay eager (engine/mtp.py: lockstep with the other ranks).
"""

from __future__ import annotations

import torch

from dsaserve.engine.cuda_graph_runner import CudaGraphRunner
from dsaserve.engine.decode_graphs import DecodeGraphs
from dsaserve.model.forward_batch import ForwardBatch


class MTPGraphRunner(CudaGraphRunner):
    """Graphs a batch bucket of the MTP layer's forward over one token a row (`replay_mtp`). An input id -1-j is
    the last forward's draft j (chained drafts: their tokens stay on the device), resolved inside the graph as
    overlap scheduling's placeholders are."""

    replay_counter = "mtp_graph_replays"
    mtp_layer = 0

    def __init__(self, model, pool, max_bs: int, max_pages_per_req: int, sink_page: int,
                 logits_out: torch.Tensor | None = None, table_rows: int = 0):
        dev = pool.kv_buffer.device
        super().__init__(model, pool, max_bs, max_pages_per_req, sink_page,
                         future_token_ids=torch.zeros(max_bs, dtype=torch.int64, device=dev), logits_out=logits_out,
                         table_rows=table_rows)
        # read by every graph; rows past a batch (its bucket's padding) keep stale values, which only reach padding
        self.prev_hidden = torch.zeros(max_bs, model.cfg.hidden_size, dtype=model.dtype, device=dev)

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.forward_mtp(self._static_batch(bs), self.pool, self.prev_hidden[:bs], with_hidden=True,
                                      logits_out=self.logits_out[:bs])

    def replay_mtp(self, rows: ForwardBatch, prev_hidden: torch.Tensor,
                   drafts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the layer's output) at the logits rows of `rows` (a host batch of one token a row) with the
        hidden rows `prev_hidden` [T, H], its placeholder ids taken from `drafts` (on the device, a row each at
        most): views of the graph's buffers where every row gives logits (else gathered), valid until the next
        replay. The host waits only for this runner's last replay to have read its staged inputs."""
        bs = rows.batch_size
        self.prev_hidden[:bs].copy_(prev_hidden)
        if drafts is not None:
            self.future_token_ids[:drafts.numel()].copy_(drafts)
        logits, hidden = self.replay_all_rows(rows)
        if rows.samples_every_token:
            return logits, hidden
        picked = self.logits_rows(rows)
        return logits.index_select(0, picked), hidden.index_select(0, picked)


def capture_mtp_graphs(model, pool, decode: DecodeGraphs, warm_each: bool) -> DecodeGraphs:
    """MTP graphs at the decode graphs' page-table widths and buckets, captured into their memory pool, their logits
    in the decode graphs' buffer: a step replays the verify graph, then the MTP ones, one after another on one
    stream, each read before the next."""
    graphs = DecodeGraphs(lambda pages: MTPGraphRunner(model, pool, decode.max_bs, pages, pool.sink_page,
                                                       table_rows=decode.widest.table_rows), decode.widths)
    graphs.widest.pool_handle, graphs.widest.logits_out = decode.widest.pool_handle, decode.widest.logits_out
    graphs.capture(warm_each=warm_each)
    return graphs
