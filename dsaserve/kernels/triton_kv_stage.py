"""Prefill staging on the GPU: a prefill's latent rows dequantised once to bf16 (request path stage 6, attention).

Owns: the GPU variants of `reference.stage_latent` (the rows of a list of pages of one layer's fp8_ds_mla cache,
written as bf16 rows of the bf16 layout: [pages * page_size, kv_lora + rope]) and `reference.remap_slots`
(physical top-k slots -> rows of that staging, through a page map; -1 stays -1). `model/layers/prefill_staging.py`
decides when a step stages.

Why: each of a prefill chunk's T tokens reads its 2048 selected rows, so each row of the context is read about
T * 2048 / context times, and the sparse MLA kernel dequantised it each time in registers: CUDA-core work beside
the MMAs that Triton cannot overlap (no warp specialisation on Hopper), and a register round trip for every tile.
Staged once a layer, the kernel's gathers of bf16 rows go straight to shared memory (cp.async, 2+ stages). The
numbers are the same: e4m3 x its FP32 scale, rounded to bf16 once, as the kernel's own dequantisation does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.common.kv_layout import FP8_DS_MLA, KVLayout
from dsaserve.kernels.triton_sparse_mla import cache_views
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

STAGE_ROWS = 16  # rows a program: 16 x 656 B in, 16 x 1152 B out


@triton.jit
def _stage_latent_kernel(c_ptr, cs_ptr, r_ptr, pages_ptr, out_ptr, n_rows, page_size, stride_c, stride_cs, cs_off,
                         stride_r, r_off, stride_o, DC: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr,
                         ROWS: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    rmask = r < n_rows
    page = tl.load(pages_ptr + r // page_size, mask=rmask, other=0).to(tl.int64)
    src = page * page_size + r % page_size
    d = tl.arange(0, DC)
    q = tl.load(c_ptr + src[:, None] * stride_c + d[None, :], mask=rmask[:, None], other=0)
    g = tl.arange(0, DC // 128)
    sc = tl.load(cs_ptr + src[:, None] * stride_cs + cs_off + g[None, :], mask=rmask[:, None], other=0.0)
    v = tl.reshape(q.to(tl.float8e4nv, bitcast=True).to(tl.float32), (ROWS, DC // 128, 128)) * sc[:, :, None]
    tl.store(out_ptr + r[:, None] * stride_o + d[None, :], tl.reshape(v, (ROWS, DC)).to(tl.bfloat16),
             mask=rmask[:, None])
    e = tl.arange(0, BLOCK_R)
    emask = rmask[:, None] & (e < DR)[None, :]
    rope = tl.load(r_ptr + src[:, None] * stride_r + r_off + e[None, :], mask=emask, other=0.0)
    tl.store(out_ptr + r[:, None] * stride_o + DC + e[None, :], rope, mask=emask)


@triton.jit
def _remap_slots_kernel(slot_ptr, map_ptr, out_ptr, n_keys, page_size, stride_s, stride_o, BLOCK: tl.constexpr,
                        PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    kmask = k < n_keys
    s = tl.load(slot_ptr + t * stride_s + k, mask=kmask, other=-1).to(tl.int64)
    p = tl.load(map_ptr + s // page_size, mask=kmask & (s >= 0), other=-1).to(tl.int64)
    staged = tl.where((s >= 0) & (p >= 0), p * page_size + s % page_size, -1)
    tl.store(out_ptr + t * stride_o + k, staged.to(out_ptr.dtype.element_ty), mask=kmask)


def stage_latent(kv_cache: torch.Tensor, layout: KVLayout, pages: torch.Tensor, page_size: int,
                 kv_lora_rank: int, out: torch.Tensor) -> torch.Tensor:
    """GPU `reference.stage_latent`: rows of `pages` (in order) of an fp8_ds_mla cache -> `out` [n, dc + dr] bf16."""
    if layout != FP8_DS_MLA:
        raise ValueError(f"stage_latent: only fp8_ds_mla rows are staged, not {layout}")
    dc, n = kv_lora_rank, pages.numel() * page_size
    dr = out.shape[1] - dc
    if out.shape[0] < n or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"stage_latent: out must hold {n} bf16 rows of {dc + dr}, got {tuple(out.shape)} {out.dtype}")
    c, cs, r, stride_c, stride_cs, cs_off, stride_r, r_off = cache_views(kv_cache, layout, dc, dr, "stage_latent")
    if n == 0:
        return out
    _stage_latent_kernel[(triton.cdiv(n, STAGE_ROWS),)](
        c, cs, r, pages, out, n, page_size, stride_c, stride_cs, cs_off, stride_r, r_off, out.stride(0), DC=dc,
        DR=dr, BLOCK_R=triton.next_power_of_2(dr), ROWS=STAGE_ROWS, num_warps=4, **pdl_args(kv_cache.device))
    return out


def remap_slots(slots: torch.Tensor, page_map: torch.Tensor, page_size: int) -> torch.Tensor:
    """GPU `reference.remap_slots`: [T, K] physical slots -> rows of the staging (page_map[page] * page_size +
    offset; -1, and a slot whose page is not staged, -> -1)."""
    t, k = slots.shape
    slots = slots if slots.stride(1) == 1 else slots.contiguous()  # the kernel reads a row's slots as one run
    out = torch.empty_like(slots)
    if t == 0 or k == 0:
        return out
    block = 1024
    _remap_slots_kernel[(t, triton.cdiv(k, block))](slots, page_map, out, k, page_size, slots.stride(0),
                                                   out.stride(0), BLOCK=block, num_warps=4,
                                                   **pdl_args(slots.device))
    return out
