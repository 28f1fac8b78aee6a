"""A long prompt's chunked prefill, chunk by chunk: GEMM FLOPs, indexer FLOPs, indexer-K read, KV write, sparse
MLA's KV gather and the prefill staging, collectives, and the time lower bound of each chunk.

Owns: note 001's "一次 1M prefill" table generalised to any context, chunk size, config and deployment.
Only the indexer terms grow with the prefix (each query scores every earlier key), so late chunks cost
more than early ones. A chunk the engine stages (common/causal.py's rule, the one model/layers/prefill_staging.py
decides by) dequantises its pages once a layer to bf16, and its sparse MLA gathers bf16 rows (1152 B at kv_lora 512
+ rope 64) instead of the cache's (656 B for fp8_ds_mla). Request-path stages: 3 (chunking) and 6 (the forwards).
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.common.causal import (
    keys_scored,
    keys_within_topk,
    staged_row_bytes,
    staged_rows,
    stages_latent,
    topk_selected,
)
from dsaserve.config import ModelConfig
from dsaserve.ledger.collective_plan import row_time, step_plan
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import Hardware
from dsaserve.ledger.kv import KVPerToken, kv_per_token, kv_share_per_gpu
from dsaserve.ledger.units import ceil_div
from dsaserve.ledger.weights import (
    WeightInventory,
    gemm_params_per_token,
    query_bytes_per_gpu,
    query_params_per_token,
    stored_per_gpu,
)


@dataclass(frozen=True)
class Chunk:
    index: int
    prefix: int
    tokens: int
    gemm_flops: float
    attn_flops: float
    indexer_flops: float
    indexer_read: float  # HBM bytes, after q-tile reuse, all GPUs together
    kv_write: float  # main KV, all GPUs together
    indexer_write: float
    kv_read: float  # sparse MLA's top-k gather: slots x the row it reads (staged: bf16) x KV layers
    kv_staged: float  # prefill staging: staged rows x (cache row read + bf16 row written) x KV layers; 0 unstaged
    collective_calls: int
    collective_bytes: float  # per-rank wire bytes
    compute_s: float
    memory_s: float
    comm_s: float

    @property
    def lower_bound_s(self) -> float:
        return max(self.compute_s, self.memory_s, self.comm_s)

    @property
    def staged(self) -> bool:
        return self.kv_staged > 0


@dataclass(frozen=True)
class Prefill:
    context: int
    chunk: int
    chunks: tuple[Chunk, ...]
    cross_chunk_share: float  # share of indexer pairs whose key lies in an earlier chunk

    def total(self, attr: str) -> float:
        return sum(getattr(c, attr) for c in self.chunks)


def attn_flops_per_slot(cfg: ModelConfig) -> int:
    """Absorbed sparse MLA: q.k over the 576-dim latent + p.v over the 512-dim nope part, every head."""
    return 2 * cfg.num_attention_heads * (cfg.kv_latent_dim + cfg.kv_lora_rank)


def chunked_prefill(cfg: ModelConfig, inv: WeightInventory, dep: Deployment, hw: Hardware, asm: Assumptions,
                    work: Workload, context: int | None = None, start: int = 0) -> Prefill:
    """Chunks of `work.chunk` tokens from position `start` (tokens before it are a prefix-cache hit) to `context`."""
    ctx = context or work.context
    if not 0 <= start < ctx:
        raise ValueError(f"prefill start {start} must lie in [0, context {ctx})")
    n_chunks = ceil_div(ctx - start, work.chunk)
    per_tok = kv_per_token(cfg, work.kv_layout, asm)
    gemm_per_token = 2 * gemm_params_per_token(cfg, inv, mtp=asm.speculative)
    query_per_token = 2 * query_params_per_token(inv, mtp=asm.speculative)
    lm_head = 2 * cfg.vocab_size * cfg.hidden_size
    idx_pair = 2 * cfg.index_n_heads * cfg.index_head_dim * per_tok.indexer_layers
    slot_flops = attn_flops_per_slot(cfg) * per_tok.kv_layers
    stored = stored_per_gpu(inv, dep, asm)
    weights_gpu = sum(v for k, v in stored.items() if not k.endswith("embed"))
    query_gpu = sum(v for g, v in query_bytes_per_gpu(inv, dep, asm).items() if g in stored)
    idx_ranks = dep.n_gpus if asm.indexer_split else 1
    share = kv_share_per_gpu(dep, asm)
    eff = asm.compute_efficiency
    chunks = []
    for i in range(n_chunks):
        prefix = start + i * work.chunk
        t = min(work.chunk, ctx - prefix)
        last = i == n_chunks - 1
        # a chunk within the top-k takes every key unscored (the GPU selection's `take_all`) and makes no indexer
        # queries: neither their FLOPs nor their weights' read (a whole forward's; piecewise segments still make
        # them, which the ledger does not model)
        every_key = keys_within_topk(prefix + t, asm.page_size, cfg.index_topk)
        pairs = 0 if every_key else keys_scored(prefix, t)
        gemm = (gemm_per_token - (query_per_token if every_key else 0)) * t + (lm_head if last else 0)
        slots = topk_selected(prefix, t, cfg.index_topk)
        attn = slot_flops * slots
        idx = idx_pair * pairs
        idx_read = pairs * per_tok.indexer / asm.indexer_q_tile
        kv_read, kv_staged, kv_hbm = kv_traffic(cfg, work, asm, per_tok, prefix, t, slots)
        plan = step_plan(cfg, dep, asm, t, logits_rows=1 if last else 0, mtp=asm.speculative, one_request=True)
        compute = (gemm / dep.n_gpus / hw.fp8_flops + attn / dep.n_gpus / hw.bf16_flops
                   + idx / idx_ranks / hw.fp8_flops) / eff
        weights_read = weights_gpu - (query_gpu if every_key else 0)
        memory = (idx_read / idx_ranks + (t * per_tok.total + kv_staged + kv_hbm) * share + weights_read) / hw.hbm_bw
        chunks.append(Chunk(i, prefix, t, gemm, attn, idx, idx_read, t * per_tok.main, t * per_tok.indexer,
                            kv_read, kv_staged, sum(r.calls for r in plan), sum(r.wire_bytes for r in plan),
                            compute, memory, sum(row_time(r, hw, asm) for r in plan)))
    within = sum(keys_scored(0, c.tokens) for c in chunks)
    total_pairs = sum(keys_scored(c.prefix, c.tokens) for c in chunks)
    return Prefill(ctx, work.chunk, tuple(chunks), 1 - within / total_pairs)


def kv_traffic(cfg: ModelConfig, work: Workload, asm: Assumptions, per_tok: KVPerToken, prefix: int, tokens: int,
               slots: int) -> tuple[float, float, float]:
    """(sparse MLA's gather, the staging's traffic, the gather's HBM bytes) of one request's chunk of `tokens`
    after `prefix` whose queries select `slots` rows, over its KV layers. Staged (the engine's rule on the request's
    seq_len): each row of its whole pages read at the cache's size and written as bf16, and the gather reads bf16
    rows; else the gather reads the cache's rows. HBM: `prefill_kv_gather`."""
    stage = asm.prefill_staging and stages_latent(work.kv_layout, cfg.kv_lora_rank)
    rows = staged_rows([prefix + tokens], tokens, asm.page_size) if stage else 0
    bf16_row, cache_row = staged_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim), per_tok.main_per_layer
    row = bf16_row if rows else cache_row
    from_hbm = min(slots, prefix + tokens) if asm.prefill_kv_gather == "rows" else slots
    layers = per_tok.kv_layers
    return slots * row * layers, rows * (cache_row + bf16_row) * layers, from_hbm * row * layers
