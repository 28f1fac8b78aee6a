"""KV bytes per token (main MLA latent + indexer K) and KV-pool capacity per GPU and per deployment.

Owns: the ledger's view of the byte layouts (by name, from `common/kv_layout.py`'s registry, the objects the
pool allocates with, so the two cannot disagree), the pool-size arithmetic of note 000 (mem_fraction_static
x HBM - weights, divided by bytes per token on this GPU) and how many requests of a given context fit.
Startup-chain step it predicts: "allocate the KV pool once, at its final size". Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.common.kv_layout import KVLayout, get_kv_layout
from dsaserve.config import ModelConfig
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import Hardware
from dsaserve.ledger.units import ceil_div


def _layout(layout: str | KVLayout) -> KVLayout:
    return get_kv_layout(layout, "--kv-layout", engine=False)


def layout_parts(cfg: ModelConfig, layout: str | KVLayout, nvfp4_rope: str = "fp8") -> list[tuple[str, int]]:
    """(component, bytes) of one token's main-KV row in one layer."""
    return _layout(layout).kv_parts(cfg, nvfp4_rope)


def kv_bytes_per_token_layer(cfg: ModelConfig, layout: str | KVLayout, nvfp4_rope: str = "fp8") -> int:
    return _layout(layout).kv_bytes_per_token(cfg, nvfp4_rope)


def indexer_parts(cfg: ModelConfig, layout: str | KVLayout) -> list[tuple[str, int]]:
    """Indexer K per token per full layer: FP8 key + one FP32 scale (132 B), except the debug layouts."""
    return _layout(layout).indexer_parts(cfg)


def indexer_bytes_per_token_layer(cfg: ModelConfig, layout: str | KVLayout) -> int:
    return _layout(layout).indexer_bytes_per_token(cfg)


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

    @property
    def shortfall_bytes(self) -> float:
        """How far weights + other static overrun the static share (> 0: no KV pool at all)."""
        return self.weights_bytes + self.reserved_bytes - self.static_bytes


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
