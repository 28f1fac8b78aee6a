"""KV bytes per token (main MLA latent + indexer K) and KV-pool capacity per GPU and per deployment.

Owns: the byte layouts of DESIGN.md "KV cache" re-derived without torch (a test pins them equal to
`engine/kv_pool.py`), the pool-size arithmetic of note 000 (mem_fraction_static x HBM - weights, divided
by bytes per token on this GPU) and how many requests of a given context fit. Startup-chain step it
predicts: "allocate the KV pool once, at its final size". Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dsaserve.config import ModelConfig
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import Hardware
from dsaserve.ledger.units import ceil_div

QUANT_GROUP = 128  # fp8_ds_mla: one FP32 scale per 128 nope values (FlashMLA layout)
NVFP4_GROUP = 16  # NVFP4: one FP8 e4m3 scale per 16 FP4 values


def layout_parts(cfg: ModelConfig, layout: str, nvfp4_rope: str = "fp8") -> list[tuple[str, int]]:
    """(component, bytes) of one token's main-KV row in one layer."""
    nope, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if layout == "fp8_ds_mla":  # 512 FP8 + 4 FP32 scales + 64 BF16 rope = 656 for GLM-5.3
        return [(f"{nope} FP8 nope", nope), (f"{math.ceil(nope / QUANT_GROUP)} FP32 scales",
                                             4 * math.ceil(nope / QUANT_GROUP)), (f"{rope} BF16 rope", 2 * rope)]
    if layout == "fp8_e4m3":  # 576 FP8, one per-tensor scale outside the row
        return [(f"{nope + rope} FP8 latent", nope + rope)]
    if layout == "nvfp4_ds_mla":  # 256 B of FP4 + 32 FP8 scales + 64 FP8 rope = 352 (the notes' figure)
        rope_part = (f"{rope} FP8 rope", rope) if nvfp4_rope == "fp8" else (f"{rope} BF16 rope", 2 * rope)
        return [(f"{nope} FP4 nope", ceil_div(nope, 2)),
                (f"{math.ceil(nope / NVFP4_GROUP)} FP8 scales", math.ceil(nope / NVFP4_GROUP)), rope_part]
    if layout == "bf16":
        return [(f"{nope + rope} BF16 latent", 2 * (nope + rope))]
    if layout == "fp32":
        return [(f"{nope + rope} FP32 latent", 4 * (nope + rope))]
    raise ValueError(f"--kv-layout: {layout!r} unknown")


def kv_bytes_per_token_layer(cfg: ModelConfig, layout: str, nvfp4_rope: str = "fp8") -> int:
    return sum(b for _, b in layout_parts(cfg, layout, nvfp4_rope))


def indexer_parts(cfg: ModelConfig, layout: str) -> list[tuple[str, int]]:
    """Indexer K per token per full layer: FP8 key + one FP32 scale (132 B), except the debug layouts."""
    d = cfg.index_head_dim
    if layout == "bf16":
        return [(f"{d} BF16 key", 2 * d)]
    if layout == "fp32":
        return [(f"{d} FP32 key", 4 * d)]
    return [(f"{d} FP8 key", d), ("1 FP32 scale", 4)]


def indexer_bytes_per_token_layer(cfg: ModelConfig, layout: str) -> int:
    return sum(b for _, b in indexer_parts(cfg, layout))


@dataclass(frozen=True)
class KVPerToken:
    layout: str
    main_per_layer: int
    indexer_per_layer: int
    kv_layers: int
    indexer_layers: int

    @property
    def main(self) -> int:
        return self.main_per_layer * self.kv_layers

    @property
    def indexer(self) -> int:
        return self.indexer_per_layer * self.indexer_layers

    @property
    def total(self) -> int:
        return self.main + self.indexer


def kv_per_token(cfg: ModelConfig, layout: str, asm: Assumptions) -> KVPerToken:
    """Bytes one token occupies in the pool over all layers (MTP layer only with speculation on)."""
    mtp = cfg.num_nextn_predict_layers if asm.speculative else 0
    return KVPerToken(layout, kv_bytes_per_token_layer(cfg, layout, asm.nvfp4_rope),
                      indexer_bytes_per_token_layer(cfg, layout), cfg.num_hidden_layers + mtp,
                      len(cfg.full_indexer_layers) + mtp)


def kv_share_per_gpu(dep: Deployment, asm: Assumptions) -> float:
    """Fraction of one token's KV bytes a GPU stores: 1/TP only for the notes' layer split under pure TP."""
    if not dep.dp_attention and asm.mla_kv == "split":
        return 1.0 / dep.tp
    return 1.0


@dataclass(frozen=True)
class KVCapacity:
    hbm_bytes: float
    static_bytes: float  # mem_fraction_static x HBM
    weights_bytes: float  # per GPU
    reserved_bytes: float
    pool_bytes: float  # per GPU
    bytes_per_token_gpu: float
    tokens_per_gpu: int
    pages_per_gpu: int
    cluster_tokens: int  # distinct tokens the deployment can hold
    request_tokens: int
    request_pages: int
    request_bytes: int  # one request's KV over all layers (all GPUs together)
    request_bytes_per_gpu: float
    requests_fit: int
    replicas: int


def kv_capacity(cfg: ModelConfig, dep: Deployment, hw: Hardware, work: Workload, asm: Assumptions,
                weights_per_gpu: float, context: int | None = None) -> KVCapacity:
    per_tok = kv_per_token(cfg, work.kv_layout, asm)
    share = kv_share_per_gpu(dep, asm)
    static = asm.mem_fraction_static * hw.hbm_bytes
    pool = max(static - weights_per_gpu - asm.reserved_bytes, 0.0)
    bpt_gpu = per_tok.total * share
    pages = int(pool // (bpt_gpu * asm.page_size))
    tokens = pages * asm.page_size
    ctx = context or work.context
    req_pages = ceil_div(ctx, asm.page_size)
    replicas = max(dep.n_gpus // max(dep.tp, dep.ep), 1)
    per_rank_requests = pages // req_pages  # a request never straddles two pools
    holders = dep.dp if dep.dp_attention else 1
    return KVCapacity(
        hw.hbm_bytes, static, weights_per_gpu, asm.reserved_bytes, pool, bpt_gpu, tokens, pages,
        tokens * holders * replicas, ctx, req_pages, per_tok.total * ctx, per_tok.total * ctx * share,
        per_rank_requests * holders * replicas, replicas)


def block_table_bytes(batch: int, context: int, asm: Assumptions) -> tuple[int, int]:
    """(page ids, bytes) of the block table of `batch` requests of `context` tokens (stage 4's copy)."""
    ids = batch * ceil_div(context, asm.page_size)
    return ids, ids * asm.page_id_bytes


def prefix_hit(prompt: int, cached: int, page_size: int) -> tuple[int, int, int]:
    """(page hashes computed, tokens reused, tokens to prefill): only full pages are hashed and shared."""
    full_pages = cached // page_size
    reused = full_pages * page_size
    return full_pages, reused, prompt - reused
