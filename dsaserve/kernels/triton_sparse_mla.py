"""GPU sparse MLA: `sparse_mla_attention` over the paged latent cache (request path stage 6, attention).

Owns: the GPU variant of `reference.sparse_mla_attention` (weight-absorbed: queries already carry W_uk,
scores on the 576-dim latent = kv_lora nope + rope, output the attention-weighted nope latent). One Triton
program takes one token, BLOCK_H heads (all heads of a token share the same selected rows, so each row is
gathered once per head block) and one split of the token's top-k slots; per BLOCK_K slots it
  gathers the rows by slot (-1 = skip), dequantises in registers (fp8_ds_mla: e4m3 nope x its FP32 scale
  per 128 values, BF16 rope; fp8_e4m3: scale 1; bf16 / fp32 plain), scores on tensor cores
  (BF16 operands, FP32 accumulation), and folds them into an online (flash) softmax.
Decode splits the top-k over several programs (flash-decoding) so a batch of one still fills the GPU,
then a small combine kernel merges the splits by their log-sum-exp; prefill (many tokens) runs unsplit.
Each program first finds its token's last valid slot (`_valid_end`) and divides the slots up to it evenly over
the splits (`_split_range`): the -1 tail of a token that sees fewer than top-k keys costs no tile and does not
leave splits idle. A token whose slots are all -1 gets zeros (the reference gives NaN):
graph padding rows stay finite.
Every program id is widened to int64 before it meets a stride: at a 131072-token prefill q_nope comes out of
cuBLAS's bmm head-major ([H, T, 512] transposed, head stride T * 512 = 2^26), so head 32's offset passes 2^31
and an int32 product wrapped into an illegal address (issue 17).
"""

from __future__ import annotations

import functools
import json

import torch
import triton
import triton.language as tl

from dsaserve.common import envs
from dsaserve.common.kv_layout import BF16, FP8_DS_MLA, FP8_E4M3, FP32, KVLayout, get_kv_layout
from dsaserve.kernels.triton_fp8_gemm import _sm_count
from dsaserve.kernels.triton_utils import TensorNote, grid_dependency_sync, opaque_index, pdl_args, prefetch_rows

_LAYOUT = {FP8_DS_MLA: 0, BF16: 1, FP32: 1, FP8_E4M3: 2}  # the kernel's LAYOUT constexpr
LOG2E = 1.4426950408889634


@triton.jit
def _valid_end(slot_ptr, row_base, k0, k1, SCAN: tl.constexpr):
    """One past the last valid (>= 0) slot of the row in [k0, k1), at least k0. Every selection path writes a
    token's slots first and -1 after (a token seeing fewer than top-k keys: its keys 0..pos), so stopping here
    skips the all -1 tiles: half the work of a batch decoding at a 1K context, most of a 1K-prompt prefill's.
    A -1 before the end is still masked in the loop, so this only bounds it, whatever the order."""
    last = k0 - 1
    for s0 in range(k0, k1, SCAN):
        o = s0 + tl.arange(0, SCAN)
        sl = tl.load(slot_ptr + row_base + o, mask=o < k1, other=-1)
        last = tl.maximum(last, tl.max(tl.where(sl >= 0, o, -1), axis=0))
    return last + 1


@triton.jit
def _slots(slot_ptr, t, stride_st, start, k1, BLOCK_K: tl.constexpr):
    """(64-bit rows, valid) of slots [start, start + BLOCK_K) of token t; -1 and slots past k1 are invalid."""
    offs_k = start + tl.arange(0, BLOCK_K)
    slot = tl.load(slot_ptr + t * stride_st + offs_k, mask=offs_k < k1, other=-1)
    valid = slot >= 0
    return opaque_index(tl.where(valid, slot, 0).to(tl.int64)), valid  # 64-bit: slots x row bytes pass 2^31


@triton.jit
def _split_range(slot_ptr, row_base, sp, n_keys, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, SCAN: tl.constexpr):
    """[k0, k1) of split `sp` of the token's slots: its valid ones (up to `_valid_end` of the row) divided evenly
    over the launch's splits in BLOCK_K tiles. A static split of the top-k put a short context's keys all on
    the first splits (batch 128 at a 1K context: 11 tiles on split 0, 5 on split 1, none on split 2)."""
    if SCAN == 0:  # static: the whole top-k divided, -1 tails masked; no dependent load before the first gather
        kend = n_keys
    else:
        kend = _valid_end(slot_ptr, row_base, 0, n_keys, SCAN)
    if SPLIT:
        per = tl.cdiv(tl.cdiv(kend, tl.num_programs(2)), BLOCK_K) * BLOCK_K
        k0 = sp * per
        k1 = tl.minimum(k0 + per, kend)
    else:
        k0 = sp * 0  # 0, typed as sp (int64) so both branches give the loop the same bounds' types
        k1 = kend + k0
    return k0, k1


@triton.jit
def _sparse_mla_kernel(qn_ptr, qr_ptr, c_ptr, cs_ptr, r_ptr, slot_ptr, o_ptr, lse_ptr,
                       n_heads, n_keys, qk_scale, dc, dr,
                       stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_c, stride_cs, cs_off, stride_r,
                       r_off, stride_st, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                       LAYOUT: tl.constexpr, SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, NG: tl.constexpr, SCAN: tl.constexpr = 256,
                       PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)  # int64 before any stride (module docstring)
    hb = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < n_heads
    offs_c = tl.arange(0, BLOCK_C)
    cmask = offs_c < dc
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < dr
    # a float32 model (eval's GPU-in-float32 comparison): float32 operands and IEEE products, no bf16 rounding
    F32: tl.constexpr = qn_ptr.dtype.element_ty == tl.float32
    qn = tl.load(qn_ptr + t * stride_qnt + offs_h[:, None] * stride_qnh + offs_c[None, :],
                 mask=hmask[:, None] & cmask[None, :], other=0.0).to(tl.float32 if F32 else tl.bfloat16)
    qr = tl.load(qr_ptr + t * stride_qrt + offs_h[:, None] * stride_qrh + offs_r[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0).to(tl.float32 if F32 else tl.bfloat16)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)  # finite: a block of all-skipped slots gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    k0, k1 = _split_range(slot_ptr, t * stride_st, sp, n_keys, BLOCK_K, SPLIT, SCAN)
    for start in range(k0, k1, BLOCK_K):
        row, valid = _slots(slot_ptr, t, stride_st, start, k1, BLOCK_K)
        c = tl.load(c_ptr + row[:, None] * stride_c + offs_c[None, :], mask=valid[:, None] & cmask[None, :], other=0)
        if LAYOUT == 0:
            sc = tl.load(cs_ptr + row[:, None] * stride_cs + cs_off + tl.arange(0, NG)[None, :],
                         mask=valid[:, None] & (tl.arange(0, NG) * 128 < dc)[None, :], other=0.0)
            c = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            c = tl.reshape(tl.reshape(c, (BLOCK_K, NG, 128)) * sc[:, :, None], (BLOCK_K, BLOCK_C))
            kr = tl.load(r_ptr + row[:, None] * stride_r + r_off + offs_r[None, :],
                         mask=valid[:, None] & rmask[None, :], other=0.0)
        elif LAYOUT == 2:
            c = c.to(tl.float8e4nv, bitcast=True)
            kr = tl.load(c_ptr + row[:, None] * stride_c + dc + offs_r[None, :],
                         mask=valid[:, None] & rmask[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        else:
            kr = tl.load(c_ptr + row[:, None] * stride_c + dc + offs_r[None, :],
                         mask=valid[:, None] & rmask[None, :], other=0.0)
        c = c.to(qn.dtype)
        s = (tl.dot(qn, tl.trans(c), input_precision="ieee" if F32 else None)
             + tl.dot(qr, tl.trans(kr.to(qn.dtype)), input_precision="ieee" if F32 else None))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 units: qk_scale = scale * log2(e)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(qn.dtype), c, input_precision="ieee" if F32 else None)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_ptrs = o_ptr + sp * stride_os + t * stride_ot + offs_h[:, None] * stride_oh + offs_c[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=hmask[:, None] & cmask[None, :])
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + sp * stride_ls + t * stride_lt + offs_h, lse, mask=hmask)


@triton.jit
def _nope_group(c_ptr, cs_ptr, row, valid, stride_c, stride_cs, cs_off, G: tl.constexpr, SCALE_FIRST: tl.constexpr,
                PLAIN: tl.constexpr):
    """Group G of the gathered rows [BK, 128] as bf16 and its scale [BK]: with SCALE_FIRST the dequantised
    values (the FP32 product rounded once, as the generic kernel's tile), else the e4m3 values (exact).
    PLAIN: bf16 rows (the bf16 layout, or a prefill's rows staged by `triton_kv_stage`), read as they are."""
    d = tl.arange(0, 128)
    c = tl.load(c_ptr + row[:, None] * stride_c + G * 128 + d[None, :], mask=valid[:, None], other=0)
    if PLAIN:  # (one return at the end: Triton 3.6 compiles the code after a constexpr branch's return)
        v = c
        sc = valid.to(tl.float32)  # unused: no scale
    else:
        sc = tl.load(cs_ptr + row * stride_cs + cs_off + G, mask=valid, other=0.0)
        if SCALE_FIRST:
            v = (c.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]).to(tl.bfloat16)
        else:
            v = c.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    return v, sc


@triton.jit
def _sparse_mla_ds4_kernel(qn_ptr, qr_ptr, c_ptr, cs_ptr, r_ptr, slot_ptr, o_ptr, lse_ptr,
                           n_heads, n_keys, qk_scale, dr,
                           stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_c, stride_cs, cs_off, stride_r,
                           r_off, stride_st, stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                           SPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_K: tl.constexpr, SCALE_FIRST: tl.constexpr, PREFETCH: tl.constexpr,
                           ROW_BYTES: tl.constexpr, PLAIN: tl.constexpr = False, SCAN: tl.constexpr = 256,
                           PDL: tl.constexpr = False):
    """fp8_ds_mla (PLAIN: bf16 rows) with kv_lora_rank 512 (GLM-5 / DeepSeek-V3.2): the four 128-value groups apart.

    SCALE_FIRST: each group dequantised on its own (the generic kernel's numbers), S one chained dot over the
    groups and the rope, out_g = p @ c_g into four accumulators. The generic kernel's whole [BK, 512] tile in
    FP32 spills (offline sm_90 compile, Triton 3.6, 64-key tiles, 8 warps, 2 stages: 420 B a thread, ~58 local
    loads a tile); a group at a time does not (0 B).
    Else: scores = sum_g s_g[key] * (q_g . c8_g[key]) and out_g = (p * s_g) @ c8_g: the e4m3 values reach the
    tensor cores exactly (e4m3 is a subset of bf16), the scales applied after each dot.
    PREFETCH: the next tile's rows (ROW_BYTES each) are asked of L2 while this tile computes.
    (FlashAttention-4's lazy rescale, one branch a program, spills 744 B a thread in this kernel: not taken.)
    """
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)  # int64 before any stride (module docstring)
    hb = tl.program_id(1).to(tl.int64)
    sp = tl.program_id(2).to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < n_heads
    d = tl.arange(0, 128)
    q_rows = qn_ptr + t * stride_qnt + offs_h[:, None] * stride_qnh + d[None, :]
    q0 = tl.load(q_rows, mask=hmask[:, None], other=0.0).to(tl.bfloat16)
    q1 = tl.load(q_rows + 128, mask=hmask[:, None], other=0.0).to(tl.bfloat16)
    q2 = tl.load(q_rows + 256, mask=hmask[:, None], other=0.0).to(tl.bfloat16)
    q3 = tl.load(q_rows + 384, mask=hmask[:, None], other=0.0).to(tl.bfloat16)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < dr
    qr = tl.load(qr_ptr + t * stride_qrt + offs_h[:, None] * stride_qrh + offs_r[None, :],
                 mask=hmask[:, None] & rmask[None, :], other=0.0).to(tl.bfloat16)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc2 = tl.zeros([BLOCK_H, 128], tl.float32)
    acc3 = tl.zeros([BLOCK_H, 128], tl.float32)
    k0, k1 = _split_range(slot_ptr, t * stride_st, sp, n_keys, BLOCK_K, SPLIT, SCAN)
    for start in range(k0, k1, BLOCK_K):
        row, valid = _slots(slot_ptr, t, stride_st, start, k1, BLOCK_K)
        if PREFETCH:  # the next tile's rows travel HBM -> L2 while this one computes (not `_slots`: its
            # opaque 64-bit rows cost ~30 more instructions a tile here, offline sm_90)
            nxt = tl.load(slot_ptr + t * stride_st + start + BLOCK_K + tl.arange(0, BLOCK_K),
                          mask=start + BLOCK_K + tl.arange(0, BLOCK_K) < k1, other=-1)
            prefetch_rows(c_ptr, tl.where(nxt >= 0, nxt, 0).to(tl.int64), stride_c, 2 if PLAIN else 1, ROW_BYTES,
                          triton.next_power_of_2(triton.cdiv(ROW_BYTES, 128)))
        kr = tl.load(r_ptr + row[:, None] * stride_r + r_off + offs_r[None, :], mask=valid[:, None] & rmask[None, :],
                     other=0.0).to(tl.bfloat16)
        c0, s0 = _nope_group(c_ptr, cs_ptr, row, valid, stride_c, stride_cs, cs_off, 0, SCALE_FIRST, PLAIN)
        c1, s1 = _nope_group(c_ptr, cs_ptr, row, valid, stride_c, stride_cs, cs_off, 1, SCALE_FIRST, PLAIN)
        c2, s2 = _nope_group(c_ptr, cs_ptr, row, valid, stride_c, stride_cs, cs_off, 2, SCALE_FIRST, PLAIN)
        c3, s3 = _nope_group(c_ptr, cs_ptr, row, valid, stride_c, stride_cs, cs_off, 3, SCALE_FIRST, PLAIN)
        s = tl.dot(qr, tl.trans(kr))
        if SCALE_FIRST:
            s = tl.dot(q0, tl.trans(c0), s)
            s = tl.dot(q1, tl.trans(c1), s)
            s = tl.dot(q2, tl.trans(c2), s)
            s = tl.dot(q3, tl.trans(c3), s)
        else:
            s += tl.dot(q0, tl.trans(c0)) * s0[None, :]
            s += tl.dot(q1, tl.trans(c1)) * s1[None, :]
            s += tl.dot(q2, tl.trans(c2)) * s2[None, :]
            s += tl.dot(q3, tl.trans(c3)) * s3[None, :]
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SCALE_FIRST:
            pb = p.to(tl.bfloat16)
            acc0 = tl.dot(pb, c0, acc0 * alpha[:, None])
            acc1 = tl.dot(pb, c1, acc1 * alpha[:, None])
            acc2 = tl.dot(pb, c2, acc2 * alpha[:, None])
            acc3 = tl.dot(pb, c3, acc3 * alpha[:, None])
        else:
            acc0 = acc0 * alpha[:, None] + tl.dot((p * s0[None, :]).to(tl.bfloat16), c0)
            acc1 = acc1 * alpha[:, None] + tl.dot((p * s1[None, :]).to(tl.bfloat16), c1)
            acc2 = acc2 * alpha[:, None] + tl.dot((p * s2[None, :]).to(tl.bfloat16), c2)
            acc3 = acc3 * alpha[:, None] + tl.dot((p * s3[None, :]).to(tl.bfloat16), c3)
        m_i = m_new
    inv = 1.0 / tl.maximum(l_i, 1e-30)[:, None]
    o_rows = o_ptr + sp * stride_os + t * stride_ot + offs_h[:, None] * stride_oh + d[None, :]
    ty = o_ptr.dtype.element_ty
    tl.store(o_rows, (acc0 * inv).to(ty), mask=hmask[:, None])
    tl.store(o_rows + 128, (acc1 * inv).to(ty), mask=hmask[:, None])
    tl.store(o_rows + 256, (acc2 * inv).to(ty), mask=hmask[:, None])
    tl.store(o_rows + 384, (acc3 * inv).to(ty), mask=hmask[:, None])
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + sp * stride_ls + t * stride_lt + offs_h, lse, mask=hmask)


@triton.jit
def split_weights(lse_ptr, t, h, n_splits, stride_ls, stride_lt, BLOCK_S: tl.constexpr):
    """Token t's, head h's merge weights over the splits [BLOCK_S]: exp2(lse - max), normalised; a split that saw
    no valid slot (lse -inf: the static split's -1 tails) weighs 0 (the combine and W_uv's fold,
    `triton_head_gemm`, both merge by it)."""
    offs_s = tl.arange(0, BLOCK_S).to(tl.int64)
    lse = tl.load(lse_ptr + offs_s * stride_ls + t * stride_lt + h, mask=offs_s < n_splits, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    return w / tl.maximum(tl.sum(w, axis=0), 1e-30)


@triton.jit
def _combine_kernel(o_ptr, lse_ptr, out_ptr, n_splits, n_heads, dc, stride_os, stride_ot, stride_oh,
                    stride_ls, stride_lt, stride_xt, stride_xh, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr,
                    PDL: tl.constexpr = False):
    """out[t, h] = the splits' partials weighted by their log-sum-exp; a split that saw no valid slot (lse -inf:
    the static split's -1 tails) is not read."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S).to(tl.int64)
    w = split_weights(lse_ptr, t, h, n_splits, stride_ls, stride_lt, BLOCK_S)
    offs_c = tl.arange(0, BLOCK_C)
    cmask = offs_c < dc
    o = tl.load(o_ptr + offs_s[:, None] * stride_os + t * stride_ot + h * stride_oh + offs_c[None, :],
                mask=(w > 0)[:, None] & cmask[None, :], other=0.0)
    res = tl.sum(o * w[:, None], axis=0)
    tl.store(out_ptr + t * stride_xt + h * stride_xh + offs_c, res.to(out_ptr.dtype.element_ty), mask=cmask)


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge the flash-decoding splits' partials [S, T, H, dc] (fp32) by their log-sum-exp [S, T, H] into out
    [T, H, dc]; one split: nothing (the kernels wrote out itself). (Column blocks of 64 or 128 a program, 4-8x the
    programs at one token: 0.9-1.1 us slower a call on the H200, bench/RESULTS.md nineteenth session.)"""
    if part.shape[0] <= 1:
        return
    t, h, dc = out.shape
    _combine_kernel[(t, h)](part, lse, out, part.shape[0], h, dc, part.stride(0), part.stride(1), part.stride(2),
                            lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
                            BLOCK_S=triton.next_power_of_2(part.shape[0]), BLOCK_C=triton.next_power_of_2(dc),
                            num_warps=4, **pdl_args(part.device))


def cache_views(kv_cache: torch.Tensor, layout: KVLayout, dc: int, dr: int, who: str = "sparse_mla_attention"):
    """(nope view, scale view, rope view, stride of each, scale/rope column offsets) for one layout (a row width
    that does not fit kv_lora_rank and the rope: an error; `triton_kv_stage` reads the cache through it too)."""
    if layout == FP8_DS_MLA:
        if dc % 128 or kv_cache.shape[1] != dc + 4 * (dc // 128) + 2 * dr:
            raise ValueError(f"{who}: kv_cache rows are {kv_cache.shape[1]} B, expected "
                             f"{dc + 4 * (dc // 128) + 2 * dr} for fp8_ds_mla at kv_lora_rank {dc}, rope {dr}")
        f32, b16 = kv_cache.view(torch.float32), kv_cache.view(torch.bfloat16)
        rope_col = (dc + 4 * (dc // 128)) // 2  # in bf16 units, after nope bytes and the scales
        return kv_cache, f32, b16, kv_cache.stride(0), f32.stride(0), dc // 4, b16.stride(0), rope_col
    if layout == FP8_E4M3:
        return kv_cache, kv_cache, kv_cache, kv_cache.stride(0), 0, 0, 0, 0
    typed = kv_cache.view(getattr(torch, layout.plain_dtype))  # the rope: each row's last dr values
    return typed, typed, typed, typed.stride(0), 0, 0, typed.stride(0), dc


# overrides of one token's config (the batch-1 decode step's tile; bench/profile_decode.py's "mla1:" A/B settings)
ONE_TOKEN_CONFIG: dict = {}
# one token whose top-k is all valid slots (`full_rows`: a batch-1 step past index_topk keys) at kv_lora 512 over
# 64-head multiples: the 64-head tile, each 128-group dequantised apart, the top-k divided statically (no valid-slot
# scan before the first gather: every slot is valid). H200, in the step (bench/RESULTS.md, thirty-eighth session):
# -30 us a b1 32K step, -27 at 128K against the 16-head tile with the scan (nineteenth session's sweep, isolated:
# 15.32 vs 16.86 us a call over 2048 valid slots). Not at fewer valid slots: a static split's programs each run a
# whole tile whatever the valid count, where the scanned split's programs past the end stop at once. Its 32 splits
# of one tile each (pick_splits) beat 16 (+39 us a b1 32K step), 64 of 32-key tiles (+16) and 32-head blocks (+117):
# H100, in the step, fastest rounds (bench/RESULTS.md, thirty-ninth session).
FULL_ROW_CONFIG: dict = {"block_h": 64, "block_k": 64, "num_warps": 8, "num_stages": 1, "grouped": "dequant",
                         "scan": 0, "prefetch": False}


@functools.lru_cache(maxsize=4)
def _env_config(raw: str) -> dict:
    """DSASERVE_SPARSE_MLA_CONFIG: a JSON object of known config keys (the error names the switch); parsed once
    per value, not on every layer's call (callers only read it)."""
    try:
        conf = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"DSASERVE_SPARSE_MLA_CONFIG: not JSON ({e}): {raw!r}") from None
    unknown = set(conf) - {"block_h", "block_k", "num_warps", "num_stages", "splits", "grouped", "prefetch", "scan"} \
        if isinstance(conf, dict) else {raw}
    if unknown:
        raise ValueError(f"DSASERVE_SPARSE_MLA_CONFIG: unknown keys {sorted(unknown)} in {raw!r}")
    return conf


def pick_splits(t: int, head_blocks: int, n_keys: int, block_k: int, sms: int) -> int:
    """Flash-decoding splits: enough programs for ~2 waves, each split at least 2 key blocks (at 1-2 tokens at
    least 64 keys). H200 sweeps at 1-2 tokens over 2048 slots (bench/sweep_decode_b1.py, bench/RESULTS.md,
    sixteenth session): 32 splits, at one token of 32-key blocks and at two of 64 (the 4-group kernel), against
    64 / 16: one token 11.3-13.8 vs 15.4-16.2 us at 1024 valid keys; two tokens 16.1-17.4 vs 21.9 at 2048."""
    progs = t * head_blocks
    if progs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, progs), n_keys // (64 if t <= 2 else 2 * block_k)))


def sparse_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout | str,
                         topk_slots: torch.Tensor, softmax_scale: float, kv_lora_rank: int,
                         out: torch.Tensor | None = None, config: dict | None = None,
                         defer_combine: bool = False, full_rows: bool = False) -> torch.Tensor:
    """GPU `reference.sparse_mla_attention` -> [T, H, kv_lora_rank] in q_nope.dtype (`out`, contiguous, when
    given: the piecewise graphs' buffer). defer_combine: a split call of up to FOLD_MAX_T tokens leaves its
    partials on `out` (`attach_splits`) instead of merging them: `head_bmm` merges them as it reads them.
    full_rows: the caller's word that every token's top-k is all valid slots (`StepContext.full_topk`): one token
    takes FULL_ROW_CONFIG's tile where it applies (a speed choice: -1 slots are masked either way).

    `config` (bench/tuning only) overrides block_h / block_k / num_warps / num_stages / splits / scan (slots a load
    of the valid-slot scan) / grouped
    (fp8_ds_mla at kv_lora 512, `_sparse_mla_ds4_kernel`: True scales after the dots, "dequant" each 128-group
    dequantised apart; False: the whole tile dequantised first, `_sparse_mla_kernel`; bf16 rows at kv_lora 512,
    the pool's or a prefill's staged ones, have no scales: any true `grouped` reads them as they are, PLAIN).
    """
    layout = get_kv_layout(layout, "sparse_mla_attention: layout")
    t, h, dc = q_nope.shape
    dr = q_rope.shape[-1]
    if dc != kv_lora_rank:
        raise ValueError(f"sparse_mla_attention: q_nope has {dc} channels, kv_lora_rank is {kv_lora_rank}")
    n_keys = topk_slots.shape[1]
    if out is None:
        out = torch.empty(t, h, dc, dtype=q_nope.dtype, device=q_nope.device)
    elif out.shape != (t, h, dc) or out.dtype != q_nope.dtype or not out.is_contiguous():
        raise ValueError(f"sparse_mla_attention: out must be a contiguous {(t, h, dc)} {q_nope.dtype} tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if t == 0:
        return out
    # H200 sweep (bench/RESULTS.md): 64 heads x 8 warps per program is 2.4x faster than 16 or 32 heads from
    # batch 32 on and in prefill (each gathered row feeds 4x more MMA rows); a batch of 1-2 tokens is
    # latency-bound: the generic kernel at 16 heads for 1 token, the 4-group kernel at 64 heads for 2
    # (bench/sweep_decode_b1.py, sixteenth session: 1.29-1.46x the generic kernel's 16-head tile with 2048 valid
    # slots, 0.98-1.13x with 1024)
    # H200 sweeps, from 3 tokens on at kv_lora 512: (2026-12-01) dequantising first and one chained dot over 64-key
    # tiles is 1.08 / 1.20 / 1.38 / 1.46x the 4-group kernel at T = 16 / 32 / 128 / 4096 (S in one dot, not five
    # with a wait and a scale each); (2026-12-01, later) each 128-group dequantised apart (no spills) and no
    # cp.async staging (1 stage) is 1.26 / 1.20 / 1.16 / 1.13x that (174 TFLOP/s at T = 4096, 138 at T = 128);
    # asking L2 for the next tile's rows is 1.07 / 1.03x more at T = 128 / 4096 but 0.85x at T = 16 (from 64 on)
    # bf16 rows (a prefill's rows staged by model/layers/prefill_staging.py) from 512 tokens: 2 stages, so the
    # gathers go straight to shared memory (cp.async) a tile ahead: 1.09x the 1-stage tile at T = 4096-16384
    big = layout in (FP8_DS_MLA, BF16) and dc == 512 and t >= 2
    staged = big and layout == BF16 and t >= 512
    cfg = {"block_h": 64 if big else 16, "block_k": 64 if big else 32, "num_warps": 8 if big else 4,
           "num_stages": 1 if big and not staged else 2, "splits": None, "grouped": "dequant" if big else False,
           "prefetch": big and t >= 64 and not staged,
           # the valid-slot scan in one load of GLM's top-2048: its loop of 8 dependent 256-slot loads cost 3-5 us a
           # program at 1-2 tokens (bench/sweep_decode_b1.py)
           "scan": max(16, min(2048, triton.next_power_of_2(n_keys)))}
    if t > 2 and envs.DSASERVE_SPARSE_MLA_CONFIG:
        cfg.update(_env_config(envs.DSASERVE_SPARSE_MLA_CONFIG))
    if t == 1:
        if full_rows and layout in (FP8_DS_MLA, BF16) and dc == 512 and h % 64 == 0:
            cfg.update(FULL_ROW_CONFIG)
        cfg.update(ONE_TOKEN_CONFIG)
    cfg.update(config or {})
    bh, bk = cfg["block_h"], cfg["block_k"]
    head_blocks = triton.cdiv(h, bh)
    splits = cfg["splits"] or pick_splits(t, head_blocks, n_keys, bk, _sm_count(q_nope))
    # no more splits than whole key tiles of a full row (the kernel divides each token's valid slots itself)
    splits = max(1, triton.cdiv(n_keys, triton.cdiv(triton.cdiv(n_keys, splits), bk) * bk))
    c, cs, r, stride_c, stride_cs, cs_off, stride_r, r_off = cache_views(kv_cache, layout, dc, dr)
    slots = topk_slots if topk_slots.stride(-1) == 1 else topk_slots.contiguous()
    if splits > 1:
        part = torch.empty(splits, t, h, dc, dtype=torch.float32, device=q_nope.device)
        lse = torch.empty(splits, t, h, dtype=torch.float32, device=q_nope.device)
    else:
        part, lse = out.unsqueeze(0), out  # lse unused when unsplit
    block_c = triton.next_power_of_2(dc)
    strides = (q_nope.stride(0), q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), stride_c, stride_cs, cs_off,
               stride_r, r_off, slots.stride(0), part.stride(0), part.stride(1), part.stride(2),
               lse.stride(0) if splits > 1 else 0, lse.stride(1) if splits > 1 else 0)
    common = {"SPLIT": splits > 1, "BLOCK_H": bh, "BLOCK_R": max(16, triton.next_power_of_2(dr)), "BLOCK_K": bk,
              "SCAN": cfg["scan"],
              "NG": max(1, block_c // 128), "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    grid = (t, head_blocks, splits)
    plain = layout == BF16
    if cfg["grouped"] and layout in (FP8_DS_MLA, BF16) and dc == 512:
        common.pop("NG")
        if plain:  # no scales: each group read as it is, S one chained dot
            cfg["grouped"] = "dequant"
        _sparse_mla_ds4_kernel[grid](q_nope, q_rope, c, cs, r, slots, part, lse, h, n_keys,
                                     softmax_scale * LOG2E, dr, *strides, SCALE_FIRST=cfg["grouped"] == "dequant",
                                     PREFETCH=cfg["prefetch"], ROW_BYTES=kv_cache.shape[1], PLAIN=plain, **common,
                                     **pdl_args(q_nope.device))
    else:
        _sparse_mla_kernel[grid](q_nope, q_rope, c, cs, r, slots, part, lse, h, n_keys,
                                 softmax_scale * LOG2E, dc, dr, *strides, LAYOUT=_LAYOUT[layout], BLOCK_C=block_c,
                                 **common, **pdl_args(q_nope.device))
    if defer_combine and splits > 1 and t <= FOLD_MAX_T:
        return attach_splits(out, part, lse)
    combine_splits(part, lse, out)
    return out


# ---- a split call's merge left to its consumer -------------------------------------------------------------
# At 1-2 tokens the merge is a launch of its own (~5 us of a batch-1 step a layer, bench/RESULTS.md nineteenth
# session) over a few MB of L2-resident partials; W_uv's per-head GEMM (`triton_head_gemm`) reads them instead of
# the merged latent. Invariant: only an output whose sole reader is `head_bmm` carries the attachment (the
# caller's `defer_combine`), and every reader that does not merge calls `take_splits` first.
FOLD_MAX_T = 2
_SPLITS = TensorNote("_dsaserve_mla_splits")


def attach_splits(out: torch.Tensor, part: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Leave a split call's partials [S, T, H, dc] and log-sum-exps [S, T, H] on its (unwritten) output."""
    return _SPLITS.attach(out, (part, lse))


def pending_splits(out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    return _SPLITS.get(out)


def take_splits(out: torch.Tensor) -> torch.Tensor:
    """`out` merged (`combine_splits`) if it still carries a split call's partials, the attachment dropped."""
    pending = pending_splits(out)
    if pending is not None:
        combine_splits(*pending, out)
        _SPLITS.drop(out)
    return out


def flops(t: int, h: int, k: int, dc: int, dr: int) -> float:
    """Score (dc + dr) and value (dc) multiply-adds per head per selected slot."""
    return 2.0 * t * h * k * (2 * dc + dr)

