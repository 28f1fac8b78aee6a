"""CUDA graphs of the MTP layer's forward (speculative decoding, engine/mtp.py; startup chain: "capture CUDA
graphs", after the decode graphs).

Owns: `MTPGraphRunner`, the decode graph runner (engine/cuda_graph_runner.py) whose graphs run the MTP layer
(`DsaForCausalLM.forward_mtp`) in place of the main model, over one token a row (`forward_batch.one_token_rows`),
with two more static inputs: the hidden rows the layer reads (the main model's, or its own output for a chained
draft) and the token ids it embeds (the host's, or a chained draft's still on the device); and `capture_mtp_graphs`,
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

import dataclasses

import torch

from dsaserve.engine.cuda_graph_runner import CudaGraphRunner
from dsaserve.engine.decode_graphs import DecodeGraphs
from dsaserve.model.forward_batch import ForwardBatch


class MTPGraphRunner(CudaGraphRunner):
    """Graphs a batch bucket of the MTP layer's forward over one token a row (`replay_mtp`)."""

    replay_counter = "mtp_graph_replays"
    mtp_layer = 0

    def __init__(self, model, pool, max_bs: int, max_pages_per_req: int, sink_page: int):
        super().__init__(model, pool, max_bs, max_pages_per_req, sink_page)
        dev = pool.kv_buffer.device
        # read by every graph; rows past a batch (its bucket's padding) keep stale values, which only reach padding
        self.prev_hidden = torch.zeros(max_bs, model.cfg.hidden_size, dtype=model.dtype, device=dev)
        self.token_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = dataclasses.replace(self._static_batch(bs), input_ids=self.token_ids[:bs])
        return self.model.forward_mtp(batch, self.pool, self.prev_hidden[:bs], with_hidden=True)

    def replay_mtp(self, rows: ForwardBatch, prev_hidden: torch.Tensor,
                   input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the layer's output) at the logits rows of `rows` (a host batch of one token a row) with the
        hidden rows `prev_hidden` [T, H] and the tokens `input_ids` (on the device), or the batch's own: views of
        the graph's buffers (the output row by row copies), valid until the next replay."""
        bs = rows.batch_size
        self.prev_hidden[:bs].copy_(prev_hidden)
        self.token_ids[:bs].copy_(rows.input_ids if input_ids is None else input_ids, non_blocking=True)
        logits, hidden = self.replay_with_hidden(rows)
        if rows.samples_every_token:
            return logits, hidden
        return logits, hidden.index_select(0, rows.logits_indices.to(hidden.device, non_blocking=True))


def capture_mtp_graphs(model, pool, max_bs: int, widths: list[int], pool_handle, warm_each: bool) -> DecodeGraphs:
    """MTP graphs at the decode graphs' page-table widths and buckets, captured into their memory pool
    (`pool_handle`): a step replays the verify graph, then the MTP ones, one after another on one stream."""
    graphs = DecodeGraphs(lambda pages: MTPGraphRunner(model, pool, max_bs, pages, pool.sink_page), widths)
    graphs.widest.pool_handle = pool_handle
    graphs.capture(warm_each=warm_each)
    return graphs
