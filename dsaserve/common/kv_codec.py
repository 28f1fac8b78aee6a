"""The KV layouts' codec in torch: quantise on write, dequantise on read (request path stage 6).

Owns: the byte rows of `kv_layout.py` as tensors — the CPU reference of the KV write and of the reads of
sparse MLA and the indexer (`kernels/reference.py`), which the Triton kernels reproduce exactly (scale =
max(amax, 1e-12) / 448, values clamped to +-448, round to nearest). `layout` is a KVLayout or its name.
"""

from __future__ import annotations

import math

import torch

from dsaserve.common.kv_layout import FP8_MAX, QUANT_GROUP, KVLayout, get_kv_layout


def _plain(layout: KVLayout) -> torch.dtype | None:
    return getattr(torch, layout.plain_dtype) if layout.plain_dtype else None


def _quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row, per-`group` FP8 quantisation: returns (fp8 values, float32 scales [.., ceil(D/group)])."""
    d = x.shape[-1]
    ng = math.ceil(d / group)
    pad = ng * group - d
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(*x.shape[:-1], ng, group)
    scale = (xf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*x.shape[:-1], ng * group)[..., :d], scale


def encode_latent(latent: torch.Tensor, layout: KVLayout | str, kv_lora_rank: int) -> torch.Tensor:
    """latent [T, kv_lora_rank + rope] -> uint8 rows [T, kv_bytes_per_token] in `layout`."""
    layout, t = get_kv_layout(layout), latent.shape[0]
    if (plain := _plain(layout)) is not None:
        return latent.to(plain).contiguous().view(torch.uint8).view(t, -1)
    if layout.latent == "e4m3":
        return latent.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous().view(torch.uint8)
    q, scale = _quant_fp8(latent[:, :kv_lora_rank], QUANT_GROUP)
    rope = latent[:, kv_lora_rank:].to(torch.bfloat16).contiguous()
    return torch.cat([q.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8),
                      rope.view(torch.uint8)], dim=1)


def decode_latent(rows: torch.Tensor, layout: KVLayout | str, kv_lora_rank: int) -> torch.Tensor:
    """uint8 rows [N, bytes] -> float32 latent [N, kv_lora_rank + rope] (bf16/fp32 layouts keep dtype)."""
    layout, n = get_kv_layout(layout), rows.shape[0]
    if (plain := _plain(layout)) is not None:
        return rows.contiguous().view(plain)
    if layout.latent == "e4m3":
        return rows.contiguous().view(torch.float8_e4m3fn).float()
    ng = math.ceil(kv_lora_rank / QUANT_GROUP)
    q = rows[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, kv_lora_rank: kv_lora_rank + 4 * ng].contiguous().view(torch.float32)
    nope = q.view(n, -1) * scale.repeat_interleave(QUANT_GROUP, dim=1)[:, :kv_lora_rank]
    rope = rows[:, kv_lora_rank + 4 * ng:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1)


def encode_index_k(k: torch.Tensor, layout: KVLayout | str) -> torch.Tensor:
    """Indexer keys [T, D] -> uint8 rows: FP8 + FP32 scale (132 B), or plain bf16/fp32 in debug layouts."""
    if (plain := _plain(get_kv_layout(layout))) is not None:
        return k.to(plain).contiguous().view(torch.uint8).view(k.shape[0], -1)
    q, scale = _quant_fp8(k, k.shape[-1])
    return torch.cat([q.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)], dim=1)


def decode_index_k(rows: torch.Tensor, layout: KVLayout | str) -> torch.Tensor:
    if (plain := _plain(get_kv_layout(layout))) is not None:
        return rows.contiguous().view(plain)
    d = rows.shape[1] - 4
    return rows[:, :d].contiguous().view(torch.float8_e4m3fn).float() * rows[:, d:].contiguous().view(torch.float32)
