"""KVPool: the paged MLA latent cache and the indexer-key cache, allocated once (startup chain: "allocate
the KV pool once, at its final size"; request path stage 6: KV write / sparse read).

Owns: the byte layouts of DESIGN.md "KV cache" and their quantise-on-write / dequantise-on-read. One
uint8 tensor holds every layer's main KV, one more the indexer K of the full layers; neither is ever
grown or moved (captured CUDA graphs hold their addresses). Page bookkeeping (which page belongs to
whom) lives in `engine/page_allocator.py`; this file only stores bytes at slots.

Per token per layer (GLM-5.3 dims: kv_lora_rank 512, rope 64, index_head_dim 128):
  fp8_ds_mla  656 B = 512 FP8 nope + 4 FP32 scales (one per 128 nope values) + 64 BF16 rope
  fp8_e4m3    576 B = 576 FP8 (per-tensor scale 1.0, as vLLM's default k_scale)
  bf16       1152 B = 576 BF16
  fp32       2304 B = 576 FP32 (exact reference mode: the HF-oracle tests compare logits bit-for-bit
                      closer than any quantised layout allows)
  indexer     132 B = 128 FP8 + 1 FP32 scale (full indexer layers only; BF16 / FP32 keys in the
                      bf16 / fp32 debugging layouts)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dsaserve.config import ModelConfig

PAGE_SIZE = 64
FP8_MAX = 448.0  # largest finite float8_e4m3fn
QUANT_GROUP = 128  # fp8_ds_mla: one float32 scale per 128 nope values
_PLAIN = {"bf16": torch.bfloat16, "fp32": torch.float32}  # unquantised debugging layouts
KV_LAYOUTS = ("fp8_ds_mla", "fp8_e4m3", "bf16", "fp32")


def kv_bytes_per_token(cfg: ModelConfig, layout: str) -> int:
    """Main-KV bytes per token per layer for a layout (656 / 576 / 1152 for GLM-5.3)."""
    if layout == "fp8_ds_mla":
        return cfg.kv_lora_rank + 4 * math.ceil(cfg.kv_lora_rank / QUANT_GROUP) + 2 * cfg.qk_rope_head_dim
    if layout == "fp8_e4m3":
        return cfg.kv_latent_dim
    if layout == "bf16":
        return 2 * cfg.kv_latent_dim
    if layout == "fp32":
        return 4 * cfg.kv_latent_dim
    raise ValueError(f"kv_layout: {layout!r} not one of {', '.join(KV_LAYOUTS)}")


def indexer_bytes_per_token(cfg: ModelConfig, layout: str = "fp8_ds_mla") -> int:
    """Indexer-K bytes per token per full layer: FP8 key + one FP32 scale (132 for GLM-5.3)."""
    return {"bf16": 2 * cfg.index_head_dim, "fp32": 4 * cfg.index_head_dim}.get(layout, cfg.index_head_dim + 4)


@dataclass(frozen=True)
class KVPoolInfo:
    """What the pool reports (startup manifest, ledger reconcile)."""

    layout: str
    page_size: int
    num_pages: int
    num_tokens: int
    kv_layers: int
    indexer_layers: int
    kv_bytes_per_token_per_layer: int
    indexer_bytes_per_token_per_layer: int
    bytes_per_token: int
    total_bytes: int


def pool_pages_for_budget(cfg: ModelConfig, layout: str, budget_bytes: int, kv_layer_ids: list[int],
                          page_size: int = PAGE_SIZE) -> int:
    """How many pages a byte budget buys (main KV on every KV layer + indexer K on full layers)."""
    per_token = kv_bytes_per_token(cfg, layout) * len(kv_layer_ids) + indexer_bytes_per_token(cfg, layout) * sum(
        cfg.is_full_indexer(i) for i in kv_layer_ids)
    return max(int(budget_bytes // (per_token * page_size)), 0)


def _quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-`group` FP8 quantisation: returns (fp8 values, float32 scales [.., ceil(D/group)])."""
    d = x.shape[-1]
    ng = math.ceil(d / group)
    pad = ng * group - d
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(*x.shape[:-1], ng, group)
    scale = (xf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*x.shape[:-1], ng * group)[..., :d], scale


def encode_latent(latent: torch.Tensor, layout: str, kv_lora_rank: int) -> torch.Tensor:
    """latent [T, kv_lora_rank + rope] -> uint8 rows [T, kv_bytes_per_token] in `layout`."""
    t = latent.shape[0]
    if layout in _PLAIN:
        return latent.to(_PLAIN[layout]).contiguous().view(torch.uint8).view(t, -1)
    if layout == "fp8_e4m3":
        return latent.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous().view(torch.uint8)
    q, scale = _quant_fp8(latent[:, :kv_lora_rank], QUANT_GROUP)
    rope = latent[:, kv_lora_rank:].to(torch.bfloat16).contiguous()
    return torch.cat([q.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8),
                      rope.view(torch.uint8)], dim=1)


def decode_latent(rows: torch.Tensor, layout: str, kv_lora_rank: int) -> torch.Tensor:
    """uint8 rows [N, bytes] -> float32 latent [N, kv_lora_rank + rope] (bf16/fp32 layouts keep dtype)."""
    n = rows.shape[0]
    if layout in _PLAIN:
        return rows.contiguous().view(_PLAIN[layout])
    if layout == "fp8_e4m3":
        return rows.contiguous().view(torch.float8_e4m3fn).float()
    ng = math.ceil(kv_lora_rank / QUANT_GROUP)
    q = rows[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, kv_lora_rank: kv_lora_rank + 4 * ng].contiguous().view(torch.float32)
    nope = q.view(n, -1) * scale.repeat_interleave(QUANT_GROUP, dim=1)[:, :kv_lora_rank]
    rope = rows[:, kv_lora_rank + 4 * ng:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1)


def encode_index_k(k: torch.Tensor, layout: str) -> torch.Tensor:
    """Indexer keys [T, D] -> uint8 rows: FP8 + FP32 scale (132 B), or plain bf16/fp32 in debug layouts."""
    if layout in _PLAIN:
        return k.to(_PLAIN[layout]).contiguous().view(torch.uint8).view(k.shape[0], -1)
    q, scale = _quant_fp8(k, k.shape[-1])
    return torch.cat([q.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)


def decode_index_k(rows: torch.Tensor, layout: str) -> torch.Tensor:
    if layout in _PLAIN:
        return rows.contiguous().view(_PLAIN[layout])
    d = rows.shape[1] - 4
    return rows[:, :d].contiguous().view(torch.float8_e4m3fn).float() * rows[:, d:].contiguous().view(torch.float32)


class KVPool:
    """Paged storage for the MLA latent (`kv_lora_rank` nope + `qk_rope_head_dim` rope) and indexer K."""

    def __init__(self, cfg: ModelConfig, num_pages: int, layout: str = "fp8_ds_mla",
                 kv_layer_ids: list[int] | None = None, page_size: int = PAGE_SIZE,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", sink_pages: int = 0):
        if layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: {layout!r} not one of {', '.join(KV_LAYOUTS)}")
        if num_pages <= 0:
            raise ValueError(f"num_pages: the KV pool needs at least one page, got {num_pages}")
        self.cfg, self.layout, self.page_size, self.dtype = cfg, layout, page_size, dtype
        self.num_pages = num_pages  # pages the scheduler may hand out
        # sink pages sit after them: CUDA-graph padding rows write their KV there, no request ever reads it
        self.sink_page = num_pages if sink_pages else -1
        self.num_slots = (num_pages + sink_pages) * page_size
        self.kv_layer_ids = list(kv_layer_ids if kv_layer_ids is not None else range(cfg.num_hidden_layers))
        self.layer_row = {lid: i for i, lid in enumerate(self.kv_layer_ids)}
        self.index_row = {lid: i for i, lid in enumerate(x for x in self.kv_layer_ids if cfg.is_full_indexer(x))}
        self.kv_bpt = kv_bytes_per_token(cfg, layout)
        self.idx_bpt = indexer_bytes_per_token(cfg, layout)
        # the one allocation of each cache: [layers, slots, bytes]
        self.kv_buffer = torch.zeros(len(self.kv_layer_ids), self.num_slots, self.kv_bpt, dtype=torch.uint8,
                                     device=device)
        self.index_buffer = torch.zeros(max(len(self.index_row), 1), self.num_slots, self.idx_bpt,
                                        dtype=torch.uint8, device=device)
        self.kv_lora_rank = cfg.kv_lora_rank

    def info(self) -> KVPoolInfo:
        per_token = self.kv_bpt * len(self.kv_layer_ids) + self.idx_bpt * len(self.index_row)
        return KVPoolInfo(self.layout, self.page_size, self.num_pages, self.num_pages * self.page_size,
                          len(self.kv_layer_ids),
                          len(self.index_row), self.kv_bpt, self.idx_bpt, per_token,
                          self.kv_buffer.numel() + (self.index_buffer.numel() if self.index_row else 0))

    def kv_cache(self, layer: int) -> torch.Tensor:
        """The uint8 [slots, kv_bytes] rows of one layer (what the kernels take)."""
        return self.kv_buffer[self.layer_row[layer]]

    def index_cache(self, layer: int) -> torch.Tensor:
        return self.index_buffer[self.index_row[layer]]

    # convenience accessors (tests, debugging); the model goes through the kernels
    def write_latent(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        self.kv_cache(layer).index_copy_(0, slots, encode_latent(latent, self.layout, self.kv_lora_rank))

    def read_latent(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        rows = self.kv_cache(layer).index_select(0, slots.reshape(-1))
        return decode_latent(rows, self.layout, self.kv_lora_rank).to(self.dtype).view(*slots.shape, -1)

    def write_index_k(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        self.index_cache(layer).index_copy_(0, slots, encode_index_k(k, self.layout))

    def read_index_k(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        rows = self.index_cache(layer).index_select(0, slots.reshape(-1))
        return decode_index_k(rows, self.layout).to(self.dtype).view(*slots.shape, -1)
