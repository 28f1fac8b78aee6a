"""GPU sparse MLA with swapped MMA operands (swap-AB): keys as the MMA's M, heads as its N (issue 17; request path
stage 6, attention).

Owns: `sparse_mla_attention_swap`, the same op as `reference.sparse_mla_attention` (weight-absorbed: scores on the
latent = kv_lora nope + rope, output the attention-weighted nope latent), and `sparse_mla_attention`, the
dispatcher the registry binds when `registry.SPARSE_MLA_SWAP_AB` is on (this kernel from SWAP_MIN_TOKENS tokens
on, `triton_sparse_mla`'s split-K kernel below and for latents it does not take).
Why swapped: Triton gives a dot whose result feeds another dot all warps along M. With 64 heads as M (the other
kernels) and 8 warps, both warpgroups computed the same S; with 4 warps the [64, 512] fp32 accumulator does
not fit, so each program took half the columns and S ran twice per token. Here one program takes one token,
all its heads (<= 64, the N of every MMA) and all 512 output columns, and per BLOCK_K (128) gathered rows
  S^T [keys, heads] = sum_g C_g Q_g^T + R Q_rope^T   (M = 128 keys: 64 per warpgroup, S computed once),
  softmax statistics over keys (axis 0), in fp32 / exp2,
  O_g^T [GW, heads] += C_g^T P^T                       (M = the latent columns, the same gathered tile),
with the latent in four groups g of GW = 128 columns (fp8_ds_mla's scale groups): the e4m3 values reach the
tensor cores exactly as bf16 (e4m3 is a subset), their FP32 scale goes on S's rows and on P^T's rows per
group, so the tile is dequantised once (a convert, no multiply) and no FP32 copy of it is made. Four groups
also keep each operand tile at 32 KB of shared memory (a [128, 512] bf16 tile would be 128 KB beside Q's 72).
RELOAD gathers C_g again (L1 / L2) for the value dot instead of keeping the score dot's tile live.
Few tokens split the top-k over programs (flash-decoding), merged by `triton_sparse_mla`'s combine kernel.
Row offsets and every program id are 64-bit (slots x row bytes and a head-major q at 131072 tokens pass 2^31).
Configs: DEFAULT; bench/sweep_sparse_mla_swap.py times them, bench/offline_sm90.py --kernel swap compiles them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.common.kv_layout import KVLayout, get_kv_layout
from dsaserve.kernels import triton_sparse_mla
from dsaserve.kernels.triton_fp8_gemm import _sm_count
from dsaserve.kernels.triton_sparse_mla import LOG2E, _slots, _valid_end, combine_splits
from dsaserve.kernels.triton_sparse_mla_tc import (
    _LAYOUT,
    RESCALE_LOG2,
    _cache_view,
    _gather_rope,
    _out_buffer,
    _rope_bf16,
    _split_partials,
    pick_splits,
)
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

SWAP_MIN_TOKENS = 16  # the dispatcher's switch-over (issue 17: prefill and decode batches >= 16)
MAX_LATENT = 512  # four groups of <= 128 columns: one fp8_ds_mla scale each, 128 accumulator registers a thread
# 8 warps x 128-key tiles: two warpgroups of 64 keys each along S's M; O^T [512, 64] fp32 is 128 registers a
# thread. Offline sm_90 compile (Triton 3.9, T=4096): 68 wgmma a tile (S once), 88 KB of shared memory, 255
# registers and ~1.1 KB spilled: Triton feeds the group tiles to wgmma from registers (32 a tile), so keeping
# them across the softmax spills more (1.7 KB); 32 heads spill 0.3 KB; 2 stages do use cp.async for the
# gathers but take 203 KB and spill 4 KB. The sweep
# decides num_stages (2: Triton's pipeliner stages the gathers with cp.async), lazy (rescale O only when a
# head's maximum grew by more than 2^RESCALE_LOG2, FlashAttention-4's trick) and block_h (32 heads: half the
# accumulator registers, each row gathered by two programs).
DEFAULT = {"block_k": 128, "num_warps": 8, "num_stages": 1, "reload": True, "lazy": False, "block_h": 64,
           "splits": None}


@triton.jit
def _group_tile(c_ptr, row, valid, stride_c, G: tl.constexpr, LAYOUT: tl.constexpr, DC: tl.constexpr,
                GW: tl.constexpr, EVICT: tl.constexpr):
    """Latent columns [G * GW, (G + 1) * GW) of the gathered rows as bf16 [BLOCK_K, GW] (e4m3 exact, bf16 plain,
    fp32 rounded once) and their fp8_ds_mla scale [BLOCK_K] (1 on the other layouts; 0 on skipped rows).
    EVICT differs between a gather and its RELOAD: identical loads would be merged by the compiler's CSE."""
    cols = G * GW + tl.arange(0, GW)
    base = c_ptr + row * stride_c  # row is int64: offsets past 2^31 bytes stay exact
    if G * GW + GW <= DC:
        raw = tl.load(base[:, None] + cols[None, :], mask=valid[:, None], other=0, eviction_policy=EVICT)
    else:
        raw = tl.load(base[:, None] + cols[None, :], mask=valid[:, None] & (cols < DC)[None, :], other=0,
                      eviction_policy=EVICT)
    if LAYOUT == 1:
        x = raw.to(tl.bfloat16)
    else:
        x = raw.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    if LAYOUT == 0:  # FP32 scales after the DC nope bytes; GW divides 128, so the group has one scale
        sc = tl.load((base + DC).to(tl.pointer_type(tl.float32)) + (G * GW) // 128, mask=valid, other=0.0)
    else:
        sc = tl.where(valid, 1.0, 0.0)
    return x, sc


@triton.jit
def _q_group(q_base, hmask, G: tl.constexpr, DC: tl.constexpr, GW: tl.constexpr):
    """Q_g^T [GW, BLOCK_H] as bf16 (zeros past DC and for masked heads): the B operand of the score dot."""
    cols = G * GW + tl.arange(0, GW)
    return tl.load(q_base + cols[:, None], mask=(cols < DC)[:, None] & hmask[None, :], other=0.0).to(tl.bfloat16)


@triton.jit
def _score(s, c, q, sc, LAYOUT: tl.constexpr):
    """S^T += (C_g Q_g^T) x the rows' scale (fp8_ds_mla), else chained into the same accumulator."""
    if LAYOUT == 0:
        s += tl.dot(c, q) * sc[:, None]
    else:
        s = tl.dot(c, q, s)
    return s


@triton.jit
def _value(acc, c, p, sc, LAYOUT: tl.constexpr):
    """O_g^T += C_g^T (P^T x the rows' scale): the scale goes on P's rows, so C_g stays exact e4m3."""
    if LAYOUT == 0:
        p = p * sc[:, None]
    return tl.dot(tl.trans(c), p.to(tl.bfloat16), acc)


@triton.jit
def _store_group(o_base, acc, inv, hmask, G: tl.constexpr, DC: tl.constexpr, GW: tl.constexpr):
    cols = G * GW + tl.arange(0, GW)
    tl.store(o_base + cols[:, None], (acc * inv[None, :]).to(o_base.dtype.element_ty),
             mask=(cols < DC)[:, None] & hmask[None, :])


@triton.jit
def _sparse_mla_swap_kernel(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, keys_per_split,
                            qk_scale, stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_c, stride_st,
                            stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                            LAYOUT: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, GW: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                            SPLIT: tl.constexpr, RELOAD: tl.constexpr, LAZY: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)  # int64 before any stride: a head-major q at 131072 tokens passes 2^31
    sp = tl.program_id(1).to(tl.int64)
    offs_h = tl.program_id(2).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < n_heads
    q_base = qn_ptr + t * stride_qnt + offs_h[None, :] * stride_qnh
    q0 = _q_group(q_base, hmask, 0, DC, GW)
    q1 = _q_group(q_base, hmask, 1, DC, GW)
    q2 = _q_group(q_base, hmask, 2, DC, GW)
    q3 = _q_group(q_base, hmask, 3, DC, GW)
    offs_r = tl.arange(0, BLOCK_R)
    qr = tl.load(qr_ptr + t * stride_qrt + offs_h[None, :] * stride_qrh + offs_r[:, None],
                 mask=(offs_r < DR)[:, None] & hmask[None, :], other=0.0).to(tl.bfloat16)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)  # finite: a tile of skipped slots gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([GW, BLOCK_H], tl.float32)
    acc1 = tl.zeros([GW, BLOCK_H], tl.float32)
    acc2 = tl.zeros([GW, BLOCK_H], tl.float32)
    acc3 = tl.zeros([GW, BLOCK_H], tl.float32)
    k0 = sp * keys_per_split
    k1 = _valid_end(slot_ptr, t * stride_st, k0, tl.minimum(k0 + keys_per_split, n_keys), 256)  # -1 tail skipped
    for start in range(k0, k1, BLOCK_K):
        row, valid = _slots(slot_ptr, t, stride_st, start, k1, BLOCK_K)
        c0, s0 = _group_tile(c_ptr, row, valid, stride_c, 0, LAYOUT, DC, GW, "evict_last")
        c1, s1 = _group_tile(c_ptr, row, valid, stride_c, 1, LAYOUT, DC, GW, "evict_last")
        c2, s2 = _group_tile(c_ptr, row, valid, stride_c, 2, LAYOUT, DC, GW, "evict_last")
        c3, s3 = _group_tile(c_ptr, row, valid, stride_c, 3, LAYOUT, DC, GW, "evict_last")
        kr = _rope_bf16(_gather_rope(c_ptr, row, valid, stride_c, LAYOUT, DC, DR, BLOCK_R), LAYOUT, False)
        s = tl.dot(kr, qr)
        s = _score(s, c0, q0, s0, LAYOUT)
        s = _score(s, c1, q1, s1, LAYOUT)
        s = _score(s, c2, q2, s2, LAYOUT)
        s = _score(s, c3, q3, s3, LAYOUT)
        s = tl.where(valid[:, None], s * qk_scale, float("-inf"))  # log2 units: qk_scale carries log2(e)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        if LAZY:  # keep the stale maximum unless it grew by 2^RESCALE_LOG2: p <= 2^8, O rescaled on few tiles
            if tl.max(m_new - m_i, axis=0) > RESCALE_LOG2:
                alpha = tl.exp2(m_i - m_new)
                l_i, m_i = l_i * alpha, m_new
                acc0, acc1 = acc0 * alpha[None, :], acc1 * alpha[None, :]
                acc2, acc3 = acc2 * alpha[None, :], acc3 * alpha[None, :]
        else:
            alpha = tl.exp2(m_i - m_new)
            l_i, m_i = l_i * alpha, m_new
            acc0, acc1 = acc0 * alpha[None, :], acc1 * alpha[None, :]
            acc2, acc3 = acc2 * alpha[None, :], acc3 * alpha[None, :]
        p = tl.exp2(s - m_i[None, :])
        l_i += tl.sum(p, axis=0)
        if RELOAD:  # the tile again from L1 / L2: nothing of it stays live across the softmax
            c0, s0 = _group_tile(c_ptr, row, valid, stride_c, 0, LAYOUT, DC, GW, "evict_first")
            c1, s1 = _group_tile(c_ptr, row, valid, stride_c, 1, LAYOUT, DC, GW, "evict_first")
            c2, s2 = _group_tile(c_ptr, row, valid, stride_c, 2, LAYOUT, DC, GW, "evict_first")
            c3, s3 = _group_tile(c_ptr, row, valid, stride_c, 3, LAYOUT, DC, GW, "evict_first")
        acc0 = _value(acc0, c0, p, s0, LAYOUT)
        acc1 = _value(acc1, c1, p, s1, LAYOUT)
        acc2 = _value(acc2, c2, p, s2, LAYOUT)
        acc3 = _value(acc3, c3, p, s3, LAYOUT)
    inv = tl.where(l_i > 0, 1.0 / tl.maximum(l_i, 1e-30), 0.0)  # a token without slots gets zeros
    o_base = o_ptr + sp * stride_os + t * stride_ot + offs_h[None, :] * stride_oh
    _store_group(o_base, acc0, inv, hmask, 0, DC, GW)
    _store_group(o_base, acc1, inv, hmask, 1, DC, GW)
    _store_group(o_base, acc2, inv, hmask, 2, DC, GW)
    _store_group(o_base, acc3, inv, hmask, 3, DC, GW)
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + sp * stride_ls + t * stride_lt + offs_h, lse, mask=hmask)


def supports(kv_lora_rank: int) -> bool:
    """Latents this kernel takes: four groups of 16..128 columns (GLM-5.3 / DeepSeek-V3.2: 512)."""
    return 64 <= kv_lora_rank <= MAX_LATENT


def _config(config: dict | None) -> dict:
    cfg = dict(DEFAULT)
    cfg.update(config or {})
    return cfg


def launch_plan(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout,
                topk_slots: torch.Tensor, softmax_scale: float, out: torch.Tensor, cfg: dict, sms: int):
    """(partials [splits, T, H, dc], lse, grid, kernel args, constexprs) of one call, nothing launched
    (bench/offline_sm90.py compiles from it). Unsplit, the partials are `out` itself."""
    t, h, dc = q_nope.shape
    dr = q_rope.shape[-1]
    view, _ = _cache_view(kv_cache, layout, dc, dr)
    bh, bk, n_keys = min(cfg["block_h"], max(16, triton.next_power_of_2(h))), cfg["block_k"], topk_slots.shape[1]
    head_blocks = triton.cdiv(h, bh)
    # one program an SM (~170 KB of shared memory): floor, not ceiling, so 128 programs on 132 SMs is a full wave
    splits = cfg["splits"] or pick_splits(t * head_blocks, n_keys, bk, sms)
    per_split, splits, slots, part, lse = _split_partials(q_nope, out, topk_slots, splits, bk)
    meta = {"LAYOUT": _LAYOUT[layout.name], "DC": dc, "DR": dr, "GW": triton.next_power_of_2(dc) // 4,
            "BLOCK_R": max(16, triton.next_power_of_2(dr)), "BLOCK_H": bh, "BLOCK_K": bk, "SPLIT": splits > 1,
            "RELOAD": cfg["reload"], "LAZY": cfg["lazy"], "num_warps": cfg["num_warps"],
            "num_stages": cfg["num_stages"]}
    args = (q_nope, q_rope, view, slots, part, lse, h, n_keys, per_split, softmax_scale * LOG2E, q_nope.stride(0),
            q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), view.stride(0), slots.stride(0), part.stride(0),
            part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    return part, lse, (t, splits, head_blocks), args, meta


def sparse_mla_attention_swap(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                              layout: KVLayout | str, topk_slots: torch.Tensor, softmax_scale: float,
                              kv_lora_rank: int, out: torch.Tensor | None = None,
                              config: dict | None = None) -> torch.Tensor:
    """GPU `reference.sparse_mla_attention` -> [T, H, kv_lora_rank] in q_nope.dtype (swap-AB tensor-core tiles;
    into `out`, contiguous, when given). `config` (bench/tuning only) overrides DEFAULT."""
    layout = get_kv_layout(layout, "sparse_mla_attention: layout")
    dc = q_nope.shape[-1]
    if dc != kv_lora_rank or not supports(dc):
        raise ValueError(f"sparse_mla_attention_swap: q_nope has {dc} channels, kv_lora_rank is {kv_lora_rank} "
                         f"(this kernel takes 64..{MAX_LATENT})")
    out = _out_buffer(q_nope, out)
    if out.shape[0] == 0:
        return out
    part, lse, grid, args, meta = launch_plan(q_nope, q_rope, kv_cache, layout, topk_slots, softmax_scale, out,
                                              _config(config), _sm_count(q_nope))
    _sparse_mla_swap_kernel[grid](*args, **meta, **pdl_args(q_nope.device))
    combine_splits(part, lse, out)
    return out


def sparse_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout | str,
                         topk_slots: torch.Tensor, softmax_scale: float, kv_lora_rank: int,
                         out: torch.Tensor | None = None, defer_combine: bool = False,
                         full_rows: bool = False) -> torch.Tensor:
    """The registry's sparse MLA under `registry.SPARSE_MLA_SWAP_AB`: this kernel from SWAP_MIN_TOKENS tokens on
    (a step's token count is static under CUDA graphs, so each captured bucket keeps one kernel), the split-K
    flash-decoding kernel below it (a few tokens cannot fill the GPU with 64-head programs) and for latents
    outside 64..512."""
    args = (q_nope, q_rope, kv_cache, layout, topk_slots, softmax_scale, kv_lora_rank)
    if q_nope.shape[0] >= SWAP_MIN_TOKENS and supports(q_nope.shape[-1]):
        return sparse_mla_attention_swap(*args, out=out)  # merges its own splits: nothing to defer
    return triton_sparse_mla.sparse_mla_attention(*args, out=out, defer_combine=defer_combine, full_rows=full_rows)

