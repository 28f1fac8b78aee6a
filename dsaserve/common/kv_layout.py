"""KVLayout: one object per byte layout of the KV cache — its name, the parts and bytes of one token's row
(main MLA latent and indexer K), and its codec (request path stage 6: KV write / sparse read; startup chain:
"allocate the KV pool once, at its final size").

Owns: the byte layouts of DESIGN.md "KV cache" and the one registry of them (`KV_LAYOUTS`) that the CLI
choices (`engine/engine_args.py`, `cli/ledger.py`), the pool (`engine/kv_pool.py`), the kernels and the
ledger (`ledger/deployment.py`, `ledger/kv.py`) all read. Per token per layer (GLM-5.3 dims: kv_lora_rank
512, rope 64, index_head_dim 128):
  fp8_ds_mla    656 B = 512 FP8 nope + 4 FP32 scales (one per 128 nope values) + 64 BF16 rope
  fp8_e4m3      576 B = 576 FP8 (per-tensor scale 1.0, as vLLM's default k_scale)
  nvfp4_ds_mla  352 B = 256 B of FP4 nope + 32 FP8 scales + 64 FP8 rope (the notes' figure; 416 with a
                        BF16 rope): a planning layout of the ledger, the engine's pool has no codec for it
  bf16         1152 B = 576 BF16
  fp32         2304 B = 576 FP32 (exact reference mode: the HF-oracle tests compare logits closer than any
                        quantised layout allows)
  indexer       132 B = 128 FP8 + 1 FP32 scale (full indexer layers only; BF16 / FP32 keys in the bf16 /
                        fp32 debugging layouts)
Pure Python but for the codec methods, which import torch when first called (the ledger and the HTTP
process import this module without torch).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

QUANT_GROUP = 128  # fp8_ds_mla: one FP32 scale per 128 nope values (FlashMLA layout)
NVFP4_GROUP = 16  # NVFP4: one FP8 e4m3 scale per 16 FP4 values
FP8_MAX = 448.0  # largest finite float8_e4m3fn


class LatentDims(Protocol):
    """The config dims a layout's bytes depend on (ModelConfig has them)."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    index_head_dim: int


@dataclass(frozen=True)
class KVLayout:
    name: str
    latent: str  # how a row stores the latent: "ds_mla" | "e4m3" | "nvfp4" | "plain"
    plain_bytes: int = 0  # unquantised debugging layouts: element bytes of both caches (BF16 2, FP32 4)
    in_engine: bool = True  # the engine's pool stores it (False: the ledger plans with it only)

    def __str__(self) -> str:
        return self.name

    @property
    def plain_dtype(self) -> str | None:
        """torch dtype name of an unquantised layout's rows (both caches), None for the FP8 layouts."""
        return {2: "bfloat16", 4: "float32"}.get(self.plain_bytes)

    def kv_parts(self, dims: LatentDims, nvfp4_rope: str = "fp8") -> list[tuple[str, int]]:
        """(component, bytes) of one token's main-KV row in one layer."""
        nope, rope = dims.kv_lora_rank, dims.qk_rope_head_dim
        if self.latent == "ds_mla":  # 512 FP8 + 4 FP32 scales + 64 BF16 rope = 656 for GLM-5.3
            groups = math.ceil(nope / QUANT_GROUP)
            return [(f"{nope} FP8 nope", nope), (f"{groups} FP32 scales", 4 * groups), (f"{rope} BF16 rope", 2 * rope)]
        if self.latent == "e4m3":  # 576 FP8, one per-tensor scale outside the row
            return [(f"{nope + rope} FP8 latent", nope + rope)]
        if self.latent == "nvfp4":  # 256 B of FP4 + 32 FP8 scales + 64 FP8 rope = 352 (the notes' figure)
            rope_part = (f"{rope} FP8 rope", rope) if nvfp4_rope == "fp8" else (f"{rope} BF16 rope", 2 * rope)
            return [(f"{nope} FP4 nope", -(-nope // 2)),
                    (f"{math.ceil(nope / NVFP4_GROUP)} FP8 scales", math.ceil(nope / NVFP4_GROUP)), rope_part]
        width = "BF16" if self.plain_bytes == 2 else "FP32"
        return [(f"{nope + rope} {width} latent", self.plain_bytes * (nope + rope))]

    def kv_bytes_per_token(self, dims: LatentDims, nvfp4_rope: str = "fp8") -> int:
        """Main-KV bytes per token per layer (656 / 576 / 1152 / 2304 for GLM-5.3)."""
        return sum(b for _, b in self.kv_parts(dims, nvfp4_rope))

    def indexer_parts(self, dims: LatentDims) -> list[tuple[str, int]]:
        """Indexer K per token per full layer: FP8 key + one FP32 scale (132 B), plain keys in debug layouts."""
        d = dims.index_head_dim
        if self.plain_bytes:
            return [(f"{d} {'BF16' if self.plain_bytes == 2 else 'FP32'} key", self.plain_bytes * d)]
        return [(f"{d} FP8 key", d), ("1 FP32 scale", 4)]

    def indexer_bytes_per_token(self, dims: LatentDims) -> int:
        return sum(b for _, b in self.indexer_parts(dims))

    def bytes_per_token(self, dims: LatentDims, kv_layers: int, indexer_layers: int) -> int:
        """One token over `kv_layers` main-KV layers and `indexer_layers` full indexer layers."""
        return self.kv_bytes_per_token(dims) * kv_layers + self.indexer_bytes_per_token(dims) * indexer_layers

    # the codec: quantise on write, dequantise on read. Only these need torch, imported when first called, so
    # the ledger and the HTTP process use the rest without it. The Triton writes reproduce them exactly.
    def encode_latent(self, latent: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
        """latent [T, kv_lora_rank + rope] -> uint8 rows [T, kv_bytes_per_token]."""
        import torch

        t = latent.shape[0]
        if self.plain_dtype:
            return latent.to(getattr(torch, self.plain_dtype)).contiguous().view(torch.uint8).view(t, -1)
        if self.latent == "e4m3":
            return latent.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous().view(torch.uint8)
        q, scale = _quant_fp8(latent[:, :kv_lora_rank], QUANT_GROUP)
        rope = latent[:, kv_lora_rank:].to(torch.bfloat16).contiguous()
        return torch.cat([q.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8),
                          rope.view(torch.uint8)], dim=1)

    def decode_latent(self, rows: torch.Tensor, kv_lora_rank: int) -> torch.Tensor:
        """uint8 rows [N, bytes] -> float32 latent [N, kv_lora_rank + rope] (bf16/fp32 layouts keep dtype)."""
        import torch

        if self.plain_dtype:
            return rows.contiguous().view(getattr(torch, self.plain_dtype))
        if self.latent == "e4m3":
            return rows.contiguous().view(torch.float8_e4m3fn).float()
        ng = math.ceil(kv_lora_rank / QUANT_GROUP)
        q = rows[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
        scale = rows[:, kv_lora_rank: kv_lora_rank + 4 * ng].contiguous().view(torch.float32)
        nope = q.view(rows.shape[0], -1) * scale.repeat_interleave(QUANT_GROUP, dim=1)[:, :kv_lora_rank]
        rope = rows[:, kv_lora_rank + 4 * ng:].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, rope], dim=1)

    def encode_index_k(self, k: torch.Tensor) -> torch.Tensor:
        """Indexer keys [T, D] -> uint8 rows: FP8 + FP32 scale (132 B), or plain bf16/fp32 in debug layouts."""
        import torch

        if self.plain_dtype:
            return k.to(getattr(torch, self.plain_dtype)).contiguous().view(torch.uint8).view(k.shape[0], -1)
        q, scale = _quant_fp8(k, k.shape[-1])
        return torch.cat([q.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)

    def decode_index_k(self, rows: torch.Tensor) -> torch.Tensor:
        import torch

        if self.plain_dtype:
            return rows.contiguous().view(getattr(torch, self.plain_dtype))
        d = rows.shape[1] - 4
        return rows[:, :d].contiguous().view(torch.float8_e4m3fn).float() * rows[:, d:].contiguous().view(torch.float32)


def _quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-`group` FP8 quantisation: (fp8 values, float32 scales [.., ceil(D/group)]); scale =
    max(amax, 1e-12) / 448, values clamped to +-448, round to nearest."""
    import torch

    d = x.shape[-1]
    ng = math.ceil(d / group)
    xf = torch.nn.functional.pad(x.float(), (0, ng * group - d)).view(*x.shape[:-1], ng, group)
    scale = (xf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*x.shape[:-1], ng * group)[..., :d], scale


FP8_DS_MLA = KVLayout("fp8_ds_mla", "ds_mla")
FP8_E4M3 = KVLayout("fp8_e4m3", "e4m3")
NVFP4_DS_MLA = KVLayout("nvfp4_ds_mla", "nvfp4", in_engine=False)
BF16 = KVLayout("bf16", "plain", plain_bytes=2)
FP32 = KVLayout("fp32", "plain", plain_bytes=4)

KV_LAYOUTS: dict[str, KVLayout] = {x.name: x for x in (FP8_DS_MLA, FP8_E4M3, NVFP4_DS_MLA, BF16, FP32)}
ENGINE_KV_LAYOUTS: tuple[str, ...] = tuple(n for n, x in KV_LAYOUTS.items() if x.in_engine)  # --kv-layout choices
DEFAULT_KV_LAYOUT = FP8_DS_MLA.name


def get_kv_layout(layout: str | KVLayout, field: str = "kv_layout", engine: bool = True) -> KVLayout:
    """The layout object of a name (an object passes through); `engine` refuses the ledger-only layouts.
    The error names `field` (a flag or a config key)."""
    if isinstance(layout, KVLayout):
        found = layout
    else:
        found = KV_LAYOUTS.get(layout)
    choices = ENGINE_KV_LAYOUTS if engine else tuple(KV_LAYOUTS)
    if found is None or found.name not in choices:
        raise ValueError(f"{field}: {layout!r} not one of {', '.join(choices)}")
    return found


# the codec by layout name or object (the reference kernels, tests and benchmarks pass either)
def encode_latent(latent: torch.Tensor, layout: KVLayout | str, kv_lora_rank: int) -> torch.Tensor:
    return get_kv_layout(layout).encode_latent(latent, kv_lora_rank)


def decode_latent(rows: torch.Tensor, layout: KVLayout | str, kv_lora_rank: int) -> torch.Tensor:
    return get_kv_layout(layout).decode_latent(rows, kv_lora_rank)


def encode_index_k(k: torch.Tensor, layout: KVLayout | str) -> torch.Tensor:
    return get_kv_layout(layout).encode_index_k(k)


def decode_index_k(rows: torch.Tensor, layout: KVLayout | str) -> torch.Tensor:
    return get_kv_layout(layout).decode_index_k(rows)
