"""Per-step byte counters, computed once per step from the model's structure and the batch's host metadata.

Owns: the measured terms of the ledger that need no device work — `forward_steps`, `weight_bytes_read`
(every weight a forward reads but the routed experts), `kv_bytes_written` / `kv_bytes_read` and
`indexer_bytes_written` / `indexer_bytes_read` — for eager forwards (`DsaForCausalLM.forward`,
`forward_mtp`), CUDA-graph replays (`engine/cuda_graph_runner.py`) and piecewise steps alike, so they cannot
disagree. A forward whose page table is within the top-k (`common/causal.takes_every_key`) reads no indexer key,
and a whole forward there no indexer query weights (wq_b, weights_proj: `StepContext.all_keys`); piecewise
segments compute the queries at every width. The key read follows the GPU selection (`take_all`); the CPU reference
takes every key unscored only without queries, so with `indexer.SKIP_QUERIES_FOR_ALL_KEYS` off (an A/B switch) it
scores keys these counters do not count. Rows within the top-k in a wider table are counted as scored, though the
GPU decode selection skips them too (`skip_below`).
What only the device knows stays in the layers: routed experts touched (`model/layers/moe.py`) and the
collectives (`distributed/collectives.py`). Closed forms of the causal counts: `common/causal.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from dsaserve.common.causal import indexer_skips, keys_scored, table_pages, topk_selected
from dsaserve.common.counters import COUNTERS
from dsaserve.model.forward_batch import ForwardBatch
from dsaserve.model.layers import indexer as indexer_module
from dsaserve.model.layers.context import PagedKV
from dsaserve.model.layers.indexer import Indexer
from dsaserve.model.layers.linear import Linear
from dsaserve.model.layers.mla import MLAAttention
from dsaserve.model.layers.moe import Router


@dataclass(frozen=True)
class ForwardShape:
    """What one kind of forward (the main stack, or one MTP layer) reads whatever its batch."""

    weight_bytes: int  # each Linear read once (kv_b as the absorbed W_uk / W_uv), routers, lm_head
    query_weight_bytes: int  # of those, the full indexer layers' query projections (wq_b, weights_proj)
    kv_layers: int  # layers that write and read the main KV
    indexer_layers: int  # of those, the full indexer layers
    main: bool  # the main stack: one `forward_steps` (an MTP forward is not a step)


def forward_shape(layers: Sequence[nn.Module], lm_head: nn.Module, main: bool) -> ForwardShape:
    """The shape of a forward through `layers` and then `lm_head` (after loading: merged projections
    hold their parts' bytes)."""
    modules = [m for layer in layers for m in layer.modules()]
    weight = sum(m.disk_bytes for m in modules if isinstance(m, Linear))
    weight += sum(m.weight.numel() * 2 + m.e_score_correction_bias.numel() * 4
                  for m in modules if isinstance(m, Router))
    queries = sum(m.wq_b.disk_bytes + m.weights_proj.disk_bytes for m in modules if isinstance(m, Indexer))
    attn = [m for m in modules if isinstance(m, MLAAttention)]
    return ForwardShape(weight + lm_head.weight.numel() * 2, queries, len(attn),
                        sum(a.indexer is not None for a in attn), main)


def step_counts(shape: ForwardShape, pool: PagedKV, seq_lens: list[int], extend_lens: list[int],
                pages: int | None = None, segments: bool = False) -> dict[str, int]:
    """The counters one forward of `shape` adds for a batch: request r has seq_lens[r] tokens in KV after
    the step, extend_lens[r] of them new (each query at position p scores p + 1 keys and reads
    min(index_topk, p + 1) slots). `pages`: the page-table width the forward ran at (a decode graph's width class,
    a piecewise core's padded width; None: the batch's own); `segments`: it ran as piecewise segments."""
    tokens = sum(extend_lens)
    pairs = list(zip(seq_lens, extend_lens, strict=True))
    cfg = pool.cfg
    every_key, no_queries = indexer_skips(table_pages(seq_lens, pool.page_size) if pages is None else pages,
                                          pool.page_size, cfg.index_topk, segments)
    out = {"forward_steps": 1} if shape.main else {}
    skips_queries = no_queries and indexer_module.SKIP_QUERIES_FOR_ALL_KEYS
    out["weight_bytes_read"] = shape.weight_bytes - (shape.query_weight_bytes if skips_queries else 0)
    if shape.kv_layers:
        selected = sum(topk_selected(s - n, n, cfg.index_topk) for s, n in pairs)
        out["kv_bytes_written"] = tokens * pool.kv_bpt * shape.kv_layers
        out["kv_bytes_read"] = selected * pool.kv_bpt * shape.kv_layers
    if shape.indexer_layers:
        out["indexer_bytes_written"] = tokens * pool.idx_bpt * shape.indexer_layers
        scored = 0 if every_key else sum(keys_scored(s - n, n) for s, n in pairs)
        out["indexer_bytes_read"] = scored * pool.idx_bpt * shape.indexer_layers
    return out


def count_step(shape: ForwardShape, pool: PagedKV, batch: ForwardBatch, pages: int | None = None,
               segments: bool = False) -> None:
    """Add one forward's counters from the batch's host lengths (nothing while counting is off: profile,
    warmup, capture); `pages` and `segments` as `step_counts`."""
    if COUNTERS.enabled:
        pages = batch.page_table.shape[1] if pages is None else pages
        for name, value in step_counts(shape, pool, *batch.host_lens(), pages, segments).items():
            COUNTERS.add(name, value)
