"""StepContext: what every layer of one forward shares (batch metadata, KV pool, RoPE tables, kernels).

Owns: `PagedKV`, what the model reads of the KV pool (the engine's `engine/kv_pool.py` KVPool is one; the
model names the interface instead of importing the engine above it), and the per-forward context.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from dsaserve.common import causal
from dsaserve.common.kv_layout import KVLayout
from dsaserve.config import ModelConfig
from dsaserve.model.forward_batch import ForwardBatch


class PagedKV(Protocol):
    cfg: ModelConfig
    layout: KVLayout
    page_size: int
    kv_bpt: int  # main-KV bytes per token per layer
    idx_bpt: int  # indexer-K bytes per token per full layer

    def kv_cache(self, layer: int) -> torch.Tensor: ...

    def index_cache(self, layer: int) -> torch.Tensor: ...


@dataclass
class StepContext:
    batch: ForwardBatch
    pool: PagedKV
    cos: torch.Tensor | None  # [T, rope/2] (None until segment 0 makes them)
    sin: torch.Tensor | None
    ops: types.SimpleNamespace
    topk_slots: torch.Tensor | None = None  # [T, index_topk] from the last full indexer layer (all_keys: the first)
    # full layers' indexer selection overlaps the q path here; the experts-touched count and an unfused shared
    # expert (decode batches past the unsorted MoE kernel) overlap the routed experts
    side_stream: torch.cuda.Stream | None = None
    staging: Any = None  # prefill_staging.for_step's decision for this step (None: not made yet, False: none)
    # sparse MLA may leave a split decode's partials on its output for W_uv's head GEMM to merge: the core and the
    # layer's close run in one flow (not under piecewise graphs, whose segments read the output from a buffer)
    fold_combine: bool = False
    # the batch's static row bound (page-table width x page size) is at most index_topk keys: every full layer
    # takes every visible key, so its indexer computes no queries or head weights, only its key write
    # (`Indexer.prepare`). Set from the batch by the whole forward (a decode graph's width class decides it at
    # capture); never under piecewise graphs, whose segments serve batches of every width
    all_keys: bool = False
    # every row's top-k is index_topk valid slots: a one-token batch whose page table is wider than the top-k (one
    # request past index_topk keys; under decode graphs the wide class, the narrow one holding the short requests).
    # A speed hint to sparse MLA (`triton_sparse_mla.FULL_ROW_CONFIG`); wrong where no narrow class exists
    # (--disable-narrow-decode-graphs, DP-attention's gather graphs) or index_topk is no multiple of the page size (a
    # table one page wider than the top-k may hold fewer keys): those run a slower tile, never other numbers. Piecewise
    # cores (their own contexts) never set it
    full_topk: bool = False
    # tensors side-stream work reads after the main stream is done with them (the experts-touched count's ids):
    # held until the forward joins the side stream (`join_side_stream`, at the end of each forward)
    side_reads: list[torch.Tensor] = field(default_factory=list)


def takes_every_key(cfg: ModelConfig, batch: ForwardBatch) -> bool:
    """The batch's static row bound (page-table width x page size) is at most index_topk: the GPU selection's
    `take_all` condition, so every full layer's top-k is every key its rows see, whatever the scores."""
    return causal.takes_every_key(batch.page_table.shape[1], batch.page_size, cfg.index_topk)


def one_row_past_topk(cfg: ModelConfig, batch: ForwardBatch) -> bool:
    """`StepContext.full_topk`: one token, and a page table wider than the top-k."""
    return batch.num_tokens == 1 and bool(cfg.index_topk) and not takes_every_key(cfg, batch)


def join_side_stream(ctx: StepContext) -> None:
    """The end of a forward: the current stream waits for the side stream's work (a graph capture must join every
    stream it forked; the counters read it), after which the tensors that work read may be freed."""
    if ctx.side_stream is not None:
        torch.cuda.current_stream().wait_stream(ctx.side_stream)
    ctx.side_reads.clear()
