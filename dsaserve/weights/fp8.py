"""FP8 e4m3 block quantisation in the DeepSeek-V3 / GLM-5 checkpoint layout.

Owns: turning a float weight [.., N, K] into float8_e4m3fn plus a float32 `weight_scale_inv` with one
entry per 128x128 block (shape [.., ceil(N/128), ceil(K/128)]), and back. Startup chain: used by
`make-checkpoint` (quantise) and by the loader's CPU path (dequantise). The convention is the
checkpoint's: w ~= q * scale_inv, with scale_inv = block amax / 448 (448 = largest finite e4m3fn value),
so each block uses the whole e4m3 range. Partial edge blocks (N or K not a multiple of 128) get their
own scale, exactly as the reference `weight_dequant` reads them. Leading dims (stacked experts [E, N, K])
are batch dims. Everything is vectorised: blocks are a reshape of a zero-padded copy, never a loop.
"""

from __future__ import annotations

import torch

from dsaserve.config import FP8_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def _blocks(n: int) -> int:
    return -(-n // FP8_BLOCK)


def _pad_to_blocks(x: torch.Tensor, nb: int, kb: int) -> torch.Tensor:
    """Zero-pad the last two dims up to whole blocks; a no-op (no copy) when they already are."""
    n, k = x.shape[-2:]
    if (n, k) == (nb * FP8_BLOCK, kb * FP8_BLOCK):
        return x
    return torch.nn.functional.pad(x, (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))


def _check_weight(w: torch.Tensor, what: str) -> None:
    if w.dim() < 2:
        raise ValueError(f"{what}: expected a [N, K] or [E, N, K] tensor, got shape {tuple(w.shape)}")


def quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., N, K] float -> (q float8_e4m3fn [.., N, K], scale_inv float32 [.., ceil(N/128), ceil(K/128)])."""
    _check_weight(w, "quantize_fp8_block: weight")
    if not w.is_floating_point():
        raise ValueError(f"quantize_fp8_block: weight must be a float tensor, got {w.dtype}")
    *lead, n, k = w.shape
    nb, kb = _blocks(n), _blocks(k)
    w32 = w.to(torch.float32)
    # Zero padding does not change any block's amax, so edge blocks get the scale of their real part.
    padded = _pad_to_blocks(w32, nb, kb)
    blocks = padded.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK)
    amax = blocks.abs().amax(dim=-1).amax(dim=-2)  # [.., nb, kb]; two 1-dim reductions are ~4x faster on CPU
    if not torch.isfinite(amax).all():
        raise ValueError("quantize_fp8_block: weight contains inf or NaN")
    # An all-zero block would give scale 0 and 0/0 = NaN; any positive scale encodes it exactly as zeros.
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = blocks / scale_inv[..., :, None, :, None]
    # w / (amax/448) can land a rounding step above 448; e4m3fn has no inf, so clamp before the cast.
    q = scaled.clamp_(-FP8_MAX, FP8_MAX).reshape(padded.shape)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale_inv.contiguous()


def check_scale_shape(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...], name: str = "weight") -> None:
    """Raise ValueError unless scale_shape is [.., ceil(N/128), ceil(K/128)] for weight_shape [.., N, K]."""
    *lead, n, k = weight_shape
    want = (*lead, _blocks(n), _blocks(k))
    if tuple(scale_shape) != want:
        raise ValueError(f"{name}: weight_scale_inv has shape {tuple(scale_shape)}, expected {want} "
                         f"for a weight of shape {tuple(weight_shape)} (one scale per {FP8_BLOCK}x{FP8_BLOCK} block)")


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32,
                         name: str = "weight") -> torch.Tensor:
    """(q [.., N, K] fp8, scale_inv [.., ceil(N/128), ceil(K/128)]) -> q * scale_inv broadcast per block, in dtype."""
    _check_weight(q, f"{name}: fp8 weight")
    if scale_inv.dim() != q.dim():
        raise ValueError(f"{name}: weight_scale_inv has {scale_inv.dim()} dims, the fp8 weight has {q.dim()} "
                         f"(weight {tuple(q.shape)}, scale {tuple(scale_inv.shape)})")
    check_scale_shape(tuple(q.shape), tuple(scale_inv.shape), name)
    *lead, n, k = q.shape
    nb, kb = scale_inv.shape[-2:]
    # Multiply on the padded block view, then crop: same result as repeat_interleave without the big copy.
    padded = _pad_to_blocks(q.to(torch.float32), nb, kb)
    blocks = padded.reshape(*lead, nb, FP8_BLOCK, kb, FP8_BLOCK) * scale_inv.to(torch.float32)[..., :, None, :, None]
    return blocks.reshape(padded.shape)[..., :n, :k].to(dtype).contiguous()
