"""Hopper sparse MLA in Gluon for many tokens (prefill, decode batches >= 16) at kv_lora 512, rope 64 (issue 17;
request path stage 6, attention).

Owns: `sparse_mla_attention_gluon`, the same op as `reference.sparse_mla_attention` (weight-absorbed: scores on the
latent = nope + rope, output the attention-weighted nope latent) over bf16 rows (a prefill's staged rows, the
bf16 cache) or the fp8_ds_mla cache, `launch_plan` (which kernel a call launches: for unsplit bf16-row calls from
WS_MIN_TOKENS the warp-specialised one of `gluon_sparse_mla_ws`, over the fp8 cache the decode-schedule one of
`gluon_sparse_mla_dec_fp8`, else this module's) and the dispatcher `sparse_mla_attention`; the kernels' shared
prologue is `gluon_common`'s.
Why Gluon and not Triton: Triton gives a dot whose result feeds another dot all warps along M, so with 64 heads
as M both warpgroups of an 8-warp program computed the same S (53 % of the FLOPs run twice; offline sm_90 compile
of `triton_sparse_mla`'s kernel). Gluon takes the layouts as written, after FlashMLA's sparse kernels:
  S [64 heads, BLOCK_K keys] = Q C^T + Q_rope R^T   (wgmma; each warpgroup computes half of the keys, once),
  softmax statistics across both warpgroups (fp32, exp2), P to shared memory (bf16),
  O [64 heads, 512] += P C                           (wgmma; each warpgroup owns 256 output columns),
with Q, Q_rope, the key tile and P in shared memory, read by both MMAs as they are (the tile serves S as C^T
through a transposed view and O as C). bf16 rows: the next tile is gathered by cp.async into the other stage
while this one computes. fp8_ds_mla rows (656 B): the next tile's bytes are loaded into registers while this
tile's S and softmax run and dequantised (the FP32 product rounded once to bf16, as the Triton kernels) into
the other stage while its O MMA runs. One program takes one token, 64 heads and one split of its top-k
(flash-decoding splits merged by `triton_sparse_mla`'s combine kernel). Row and program offsets are 64-bit.
Shared memory: Q 72 KB + 2 x BLOCK_K x 1152 B + P; 64-key tiles take ~224 KB: one program an SM.
Gluon is Triton's lower-level language (triton.experimental.gluon, Triton >= 3.5): no interpreter, so CPU runs
never reach these kernels (`gluon_common.available` says no); their device test compares them with the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.common import envs
from dsaserve.common.kv_layout import BF16, FP8_DS_MLA, KVLayout, get_kv_layout
from dsaserve.kernels import gluon_sparse_mla_dec_fp8 as dec_fp8
from dsaserve.kernels import gluon_sparse_mla_ws as ws
from dsaserve.kernels import gluon_sparse_mla_ws_fp8 as ws_fp8
from dsaserve.kernels import triton_sparse_mla as tsm
from dsaserve.kernels.gluon_common import BLOCK_H, HAVE_GLUON, available
from dsaserve.kernels.triton_fp8_gemm import _sm_count
from dsaserve.kernels.triton_sparse_mla_tc import _out_buffer

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        async_copy,
        fence_async_shared,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    from dsaserve.kernels.gluon_common import _key_range, _load_q

LOG2E = 1.4426950408889634
# the warp-specialised kernel from the prefill staging's 512 tokens, unsplit: under them (one program an SM, few
# blocks each) its fixed cost made it 0.80-0.89x the single-partition kernel at 128-256 tokens (bench/RESULTS.md)
WS_MIN_TOKENS = 512
# The fp8 cache's kernel when a call names none (cfg "ws" None): "dec", FlashMLA's decode schedule
# (gluon_sparse_mla_dec_fp8.py: 128 tokens x 2048 keys from HBM 121.6 us against the single-partition kernel's 188 and
# the warp-specialised fp8 kernel's 171, graph-timed: bench/RESULTS.md, twenty-third session), or "single" (that kernel;
# bench/profile_decode.py --ab fp8_single; DSASERVE_SPARSE_MLA_WS=0 too). The warp-specialised fp8 kernel of the
# prefill schedule (gluon_sparse_mla_ws_fp8.py) runs only when a call's cfg "ws" is True.
FP8_DEFAULT = "dec"
GLUON_MIN_TOKENS = 16  # under it a token's 64-head tile cannot fill the GPU: the split-K Triton kernel
# kv_lora and rope (constexpr so the kernels read them); BLOCK_H, heads a program: gluon_common
DC, DR = tl.constexpr(512), tl.constexpr(64)
# (Issuing a tile's S before waiting for the previous O wgmma, so the tensor cores run both back to back: 1.00x in
# prefill, 0.88-0.91x at 32-64 tokens on the H200, bench/RESULTS.md: not kept.)
# ws None: launch_plan's rule, True / False: a warp-specialised kernel or not, "dec" (the fp8 cache only): the decode
# schedule; ws_variant: the chosen warp-specialised kernel's switches (gluon_sparse_mla_ws.VARIANTS, or
# gluon_sparse_mla_dec_fp8.SWITCHES)
DEFAULT = {"block_k": 64, "num_stages": 2, "splits": None, "ws": None, "ws_variant": None}
WAVE_FILL = 0.7  # the share of a wave of programs the fewest splits must reach (`pick_splits`)


def pick_splits(t: int, head_blocks: int, n_keys: int, block_k: int, sms: int) -> int:
    """Flash-decoding splits for these kernels: the fewest that give WAVE_FILL of a wave of programs, each split
    at least 2 key blocks. One program runs an SM (~224 KB of shared memory), so a split past one wave only adds
    waves, and each program pays a fixed ~15 us (Q in, the valid-slot scan, O or the partials out: about three
    64-key blocks of the fp8 kernel's ~5 us each). H200 sweep over the fp8 cache at decode shapes
    (bench/sweep_decode_splits.py, bench/RESULTS.md): best 1 / 2 / 3 splits at 128 / 64 / 32 tokens (128 tokens:
    112 us at 1 split against 148 us at the 3 of `triton_sparse_mla.pick_splits`' two-wave rule)."""
    progs = t * head_blocks
    want = -(-int(WAVE_FILL * sms) // max(progs, 1))
    return max(1, min(want, n_keys // (2 * block_k)))


if HAVE_GLUON:

    @gluon.jit
    def _gather_tile(c_ptr, slot_ptr, slot_base, start, k1, stride_c, r_off, k_dst, r_dst,
                     BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
        """cp.async of the rows of slots [start, start + BLOCK_K) (-1 and past k1: zero rows, nothing read) into
        k_dst [BLOCK_K, DC] and r_dst [BLOCK_K, DR]; 16 bytes a copy."""
        nope_l: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
        rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        offs = start + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, nope_l))
        sl = gl.load(slot_ptr + slot_base + offs, mask=offs < k1, other=-1)
        row = gl.where(sl >= 0, sl, 0).to(gl.int64) * stride_c
        cols = gl.arange(0, DC, layout=gl.SliceLayout(0, nope_l))
        async_copy.async_copy_global_to_shared(k_dst, c_ptr + row[:, None] + cols[None, :], mask=(sl >= 0)[:, None])
        offs_r = start + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, rope_l))
        sl_r = gl.load(slot_ptr + slot_base + offs_r, mask=offs_r < k1, other=-1)
        row_r = gl.where(sl_r >= 0, sl_r, 0).to(gl.int64) * stride_c + r_off
        cols_r = gl.arange(0, DR, layout=gl.SliceLayout(0, rope_l))
        async_copy.async_copy_global_to_shared(r_dst, c_ptr + row_r[:, None] + cols_r[None, :],
                                               mask=(sl_r >= 0)[:, None])

    @gluon.jit
    def _score_mmas(q_s, qr_s, kt, rt, s_zero):
        """S of one tile issued, not waited for: the nope and the rope wgmma (two wgmma groups)."""
        s = warpgroup_mma(q_s, kt.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        return warpgroup_mma(qr_s, rt.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _scores(s, slot_ptr, slot_base, start, k1, qk_scale):
        """S waited for, in log2 units (qk_scale carries log2(e)), -inf on skipped slots."""
        s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
        offs = start + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
        valid = gl.load(slot_ptr + slot_base + offs, mask=offs < k1, other=-1) >= 0
        return gl.where(valid[None, :], s * qk_scale, float("-inf"))

    @gluon.jit
    def _online_softmax(s, m_i, l_i, acc):
        """(P, m, l, the rescaled accumulator) after one tile. (FlashAttention-4's lazy rescale, a branch on the
        block's largest growth of a maximum, was 0.92-0.95x on the H200 here: bench/RESULTS.md.)"""
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]
        p = gl.exp2(s - m_new[:, None])
        return p, m_new, l_i * alpha + gl.sum(p, axis=1), acc

    @gluon.jit
    def _attend(q_s, qr_s, kt, rt, s_zero, p_s, slot_ptr, slot_base, start, k1, qk_scale, m_i, l_i, acc):
        """One tile: S, the online softmax, P to shared memory and the O wgmma issued (returned as its token)."""
        s = _scores(_score_mmas(q_s, qr_s, kt, rt, s_zero), slot_ptr, slot_base, start, k1, qk_scale)
        p, m_i, l_i, acc = _online_softmax(s, m_i, l_i, acc)
        p_s.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # both warpgroups read all of P
        return m_i, l_i, warpgroup_mma(p_s, kt, acc, is_async=True)

    @gluon.jit
    def _write_out(acc, m_i, l_i, o_ptr, lse_ptr, t, hb, sp, n_heads, stride_os, stride_ot, stride_oh, stride_ls,
                   stride_lt, SPLIT: gl.constexpr):
        """O / l into this program's rows (a split's partial in fp32), and its log-sum-exp when split."""
        o_l: gl.constexpr = acc.type.layout
        inv = gl.convert_layout(gl.where(l_i > 0, 1.0 / gl.maximum(l_i, 1e-30), 0.0), gl.SliceLayout(1, o_l))
        h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, o_l)).to(gl.int64)
        cols = gl.arange(0, DC, layout=gl.SliceLayout(0, o_l))
        o_ptrs = o_ptr + sp * stride_os + t * stride_ot + h[:, None] * stride_oh + cols[None, :]
        gl.store(o_ptrs, (acc * inv[:, None]).to(o_ptr.dtype.element_ty), mask=(h < n_heads)[:, None])
        if SPLIT:
            lse = gl.where(l_i > 0, m_i + gl.log2(gl.maximum(l_i, 1e-30)), float("-inf"))
            hs = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=l_i.type.layout).to(gl.int64)
            gl.store(lse_ptr + sp * stride_ls + t * stride_lt + hs, lse, mask=hs < n_heads)

    @gluon.jit
    def _prologue(qn_ptr, qr_ptr, slot_ptr, n_heads, n_keys, stride_qnt, stride_qnh, stride_qrt, stride_qrh,
                  stride_st, SPLIT: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                  num_warps: gl.constexpr):
        """A program's ids, shared memory (Q and Q_rope loaded; STAGES key tiles; P), key range and softmax state.
        Each warpgroup computes S over half the keys and O over half the columns (warps [4, 2]: M = 64 heads,
        once)."""
        t = gl.program_id(0).to(gl.int64)
        hb = gl.program_id(1).to(gl.int64)
        sp = gl.program_id(2).to(gl.int64)
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_K // 2, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, DC // 2, 16])
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DC], sw)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, DR], sw)
        k_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, DC], sw)
        r_s = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, DR], sw)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_K],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_K], gl.bfloat16))
        _load_q(q_s, qn_ptr, t, hb, n_heads, stride_qnt, stride_qnh, DC, num_warps)
        _load_q(qr_s, qr_ptr, t, hb, n_heads, stride_qrt, stride_qrh, DR, num_warps)
        slot_base = t * stride_st
        k0, k1, n_tiles = _key_range(slot_ptr, slot_base, sp, n_keys, SPLIT, BLOCK_K, num_warps)
        m_i = gl.full([BLOCK_H], -1e30, gl.float32, layout=gl.SliceLayout(1, s_l))
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=gl.SliceLayout(1, s_l))
        acc = gl.zeros([BLOCK_H, DC], gl.float32, layout=o_l)
        s_zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout=s_l)
        return t, hb, sp, q_s, qr_s, k_s, r_s, p_s, slot_base, k0, k1, n_tiles, m_i, l_i, acc, s_zero

    @gluon.jit
    def _sparse_mla_gluon_kernel(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, qk_scale,
                                 stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_c, r_off, stride_st,
                                 stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                                 SPLIT: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                                 num_warps: gl.constexpr):
        """bf16 rows: each tile gathered by cp.async STAGES - 1 tiles ahead."""
        t, hb, sp, q_s, qr_s, k_s, r_s, p_s, slot_base, k0, k1, n_tiles, m_i, l_i, acc0, s_zero = _prologue(
            qn_ptr, qr_ptr, slot_ptr, n_heads, n_keys, stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_st,
            SPLIT, BLOCK_K, STAGES, num_warps)
        acc = warpgroup_mma_init(acc0)  # an async token in the loop
        for i in gl.static_range(STAGES - 1):  # the first STAGES - 1 tiles in flight
            _gather_tile(c_ptr, slot_ptr, slot_base, k0 + i * BLOCK_K, k1, stride_c, r_off, k_s.index(i),
                         r_s.index(i), BLOCK_K, num_warps)
            async_copy.commit_group()
        for it in range(n_tiles):
            start = k0 + it * BLOCK_K
            kt = k_s.index(it % STAGES)
            rt = r_s.index(it % STAGES)
            nxt = (it + STAGES - 1) % STAGES  # the stage the previous tile's O MMA read
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            gl.thread_barrier()
            _gather_tile(c_ptr, slot_ptr, slot_base, start + (STAGES - 1) * BLOCK_K, k1, stride_c, r_off,
                         k_s.index(nxt), r_s.index(nxt), BLOCK_K, num_warps)
            async_copy.commit_group()
            async_copy.wait_group(STAGES - 1)  # this tile's copies (the later ones stay in flight)
            gl.thread_barrier()
            fence_async_shared()  # cp.async wrote through the generic proxy; wgmma reads through the async one
            m_i, l_i, acc = _attend(q_s, qr_s, kt, rt, s_zero, p_s, slot_ptr, slot_base, start, k1, qk_scale, m_i,
                                    l_i, acc)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        async_copy.wait_group(0)
        _write_out(acc, m_i, l_i, o_ptr, lse_ptr, t, hb, sp, n_heads, stride_os, stride_ot, stride_oh, stride_ls,
                   stride_lt, SPLIT)

    @gluon.jit
    def _fp8_rows(slot_ptr, slot_base, start, k1, stride_c, lay: gl.constexpr, BLOCK_K: gl.constexpr):
        """(byte offsets, valid) of the rows of slots [start, start + BLOCK_K) along `lay`'s rows."""
        offs = start + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay))
        sl = gl.load(slot_ptr + slot_base + offs, mask=offs < k1, other=-1)
        return gl.where(sl >= 0, sl, 0).to(gl.int64) * stride_c, sl >= 0

    @gluon.jit
    def _fp8_group(c_ptr, row, valid, G: gl.constexpr, lay: gl.constexpr):
        """Group G's e4m3 bytes [BLOCK_K, 128] and FP32 scale [BLOCK_K] of the gathered fp8_ds_mla rows."""
        cols = G * 128 + gl.arange(0, 128, layout=gl.SliceLayout(0, lay))
        raw = gl.load(c_ptr + row[:, None] + cols[None, :], mask=valid[:, None], other=0)
        sc = gl.load((c_ptr + row + DC + 4 * G).to(gl.pointer_type(gl.float32)), mask=valid, other=0.0)
        return raw, sc

    @gluon.jit
    def _dequant_store(k_dst, raw, sc, G: gl.constexpr):
        """Group G dequantised (the FP32 product rounded once to bf16, as the Triton kernels) into its columns."""
        v = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc[:, None]).to(gl.bfloat16)
        k_dst.slice(G * 128, 128, dim=1).store(v)

    @gluon.jit
    def _fp8_rope_copy(c_ptr, slot_ptr, slot_base, start, k1, stride_c, r_dst, BLOCK_K: gl.constexpr,
                       num_warps: gl.constexpr):
        """cp.async of the rows' BF16 rope (after the nope bytes and the scales) into r_dst [BLOCK_K, DR]."""
        rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        row, valid = _fp8_rows(slot_ptr, slot_base, start, k1, stride_c, rope_l, BLOCK_K)
        ptr = (c_ptr + row + DC + 4 * (DC // 128)).to(gl.pointer_type(gl.bfloat16))
        cols = gl.arange(0, DR, layout=gl.SliceLayout(0, rope_l))
        async_copy.async_copy_global_to_shared(r_dst, ptr[:, None] + cols[None, :], mask=valid[:, None])

    @gluon.jit
    def _sparse_mla_fp8_kernel(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, qk_scale,
                               stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_c, stride_st,
                               stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                               SPLIT: gl.constexpr, BLOCK_K: gl.constexpr, num_warps: gl.constexpr):
        """fp8_ds_mla rows (656 B: e4m3 nope, 4 FP32 scales, BF16 rope): the next tile's bytes are loaded while
        this tile's S and softmax run, dequantised into the other bf16 stage while its O MMA runs."""
        t, hb, sp, q_s, qr_s, k_s, r_s, p_s, slot_base, k0, k1, n_tiles, m_i, l_i, acc0, s_zero = _prologue(
            qn_ptr, qr_ptr, slot_ptr, n_heads, n_keys, stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_st,
            SPLIT, BLOCK_K, 2, num_warps)
        acc = warpgroup_mma_init(acc0)
        grp_l: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [num_warps, 1], [1, 0])  # 16 B a load
        row, valid = _fp8_rows(slot_ptr, slot_base, k0, k1, stride_c, grp_l, BLOCK_K)  # the first tile
        for g in gl.static_range(4):
            raw, sc = _fp8_group(c_ptr, row, valid, g, grp_l)
            _dequant_store(k_s.index(0), raw, sc, g)
        _fp8_rope_copy(c_ptr, slot_ptr, slot_base, k0, k1, stride_c, r_s.index(0), BLOCK_K, num_warps)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        for it in range(n_tiles):
            start = k0 + it * BLOCK_K
            cur = it % 2
            nxt = 1 - cur
            kt = k_s.index(cur)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            gl.thread_barrier()  # the previous O MMA (both warpgroups) read P and stage `nxt`: done
            row, valid = _fp8_rows(slot_ptr, slot_base, start + BLOCK_K, k1, stride_c, grp_l, BLOCK_K)
            raw0, sc0 = _fp8_group(c_ptr, row, valid, 0, grp_l)  # in flight during S and the softmax
            raw1, sc1 = _fp8_group(c_ptr, row, valid, 1, grp_l)
            raw2, sc2 = _fp8_group(c_ptr, row, valid, 2, grp_l)
            raw3, sc3 = _fp8_group(c_ptr, row, valid, 3, grp_l)
            _fp8_rope_copy(c_ptr, slot_ptr, slot_base, start + BLOCK_K, k1, stride_c, r_s.index(nxt), BLOCK_K,
                           num_warps)
            async_copy.commit_group()
            m_i, l_i, acc = _attend(q_s, qr_s, kt, r_s.index(cur), s_zero, p_s, slot_ptr, slot_base, start, k1,
                                    qk_scale, m_i, l_i, acc)
            _dequant_store(k_s.index(nxt), raw0, sc0, 0)  # while the O MMA runs
            _dequant_store(k_s.index(nxt), raw1, sc1, 1)
            _dequant_store(k_s.index(nxt), raw2, sc2, 2)
            _dequant_store(k_s.index(nxt), raw3, sc3, 3)
            async_copy.wait_group(0)
            fence_async_shared()
            gl.thread_barrier()  # the next tile's stage written by every thread before its S
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        _write_out(acc, m_i, l_i, o_ptr, lse_ptr, t, hb, sp, n_heads, stride_os, stride_ot, stride_oh, stride_ls,
                   stride_lt, SPLIT)


FP8_ROW = 512 + 4 * 4 + 2 * 64  # fp8_ds_mla bytes a row at kv_lora 512, rope 64


def _ws_meta(splits: int, switches: dict) -> dict:
    """A warp-specialised kernel's launch: 4 warps (its default partition) and the whole register file
    (`gluon_sparse_mla_ws.WS_MAXNREG`; warp_specialize adds the worker warpgroups), its switches as constexprs."""
    return {"SPLIT": splits > 1, "num_warps": 4, "maxnreg": ws.WS_MAXNREG, **switches}


def launch_plan(q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor, topk_slots: torch.Tensor,
                softmax_scale: float, out: torch.Tensor, cfg: dict, sms: int):
    """(kernel, partials [splits, T, H, DC], lse, grid, kernel args, constexprs) of one call, nothing launched
    (bench/offline_sm90.py compiles from it). Unsplit, the partials are `out` itself. `rows`: bf16 [slots, 576]
    (nope then rope), or the fp8_ds_mla cache as bytes [slots, 656]."""
    t, h, _ = q_nope.shape
    n_keys, bk = topk_slots.shape[1], cfg["block_k"]
    head_blocks = triton.cdiv(h, BLOCK_H.value)
    splits = cfg["splits"] or pick_splits(t, head_blocks, n_keys, bk, sms)
    splits = max(1, triton.cdiv(n_keys, triton.cdiv(triton.cdiv(n_keys, splits), bk) * bk))
    slots = topk_slots if topk_slots.stride(-1) == 1 else topk_slots.contiguous()
    if splits > 1:
        part = torch.empty(splits, t, h, DC.value, dtype=torch.float32, device=q_nope.device)
        lse = torch.empty(splits, t, h, dtype=torch.float32, device=q_nope.device)
    else:
        part, lse = out.unsqueeze(0), out.new_empty(1, 1, 1, dtype=torch.float32)  # lse unused unsplit
    strides = (part.stride(0), part.stride(1), part.stride(2), lse.stride(0), lse.stride(1))
    head = (q_nope, q_rope, rows, slots, part, lse, h, n_keys, softmax_scale * LOG2E, q_nope.stride(0),
            q_nope.stride(1), q_rope.stride(0), q_rope.stride(1), rows.stride(0))
    if cfg["ws"] not in (None, True, False, "dec") or (cfg["ws"] == "dec" and rows.dtype != torch.uint8):
        raise ValueError(f"sparse_mla_attention_gluon: cfg ws is None, True, False or (over the fp8 cache) 'dec'; "
                         f"got {cfg['ws']!r} over {rows.dtype} rows")
    meta = {"SPLIT": splits > 1, "BLOCK_K": bk, "num_warps": 8}
    fp8_ws = cfg["ws"] if cfg["ws"] is not None else "dec" if FP8_DEFAULT == "dec" and envs.DSASERVE_SPARSE_MLA_WS \
        else False
    if rows.dtype == torch.uint8 and bk == 64 and fp8_ws == "dec":
        # FlashMLA's decode schedule over the fp8 cache (gluon_sparse_mla_dec_fp8.py) and its switches
        given = cfg["ws_variant"] if cfg["ws_variant"] is not None else dec_fp8.DEFAULT_SWITCHES
        kernel, args = dec_fp8._sparse_mla_dec_fp8_kernel, (*head, dec_fp8.ROPE.value, slots.stride(0), *strides)
        meta = _ws_meta(splits, dec_fp8.variant(given))
    elif rows.dtype == torch.uint8 and bk == 64 and fp8_ws is True:
        # the warp-specialised fp8 kernel (gluon_sparse_mla_ws_fp8.py): of the switches, PIN and L2_AHEAD
        given = cfg["ws_variant"] if cfg["ws_variant"] is not None else ws_fp8.DEFAULT_SWITCHES
        switches = {k: v for k, v in ws.variant(given).items() if k in ("PIN", "L2_AHEAD")}
        kernel, args = ws_fp8._sparse_mla_ws_fp8_kernel, (*head, ws_fp8.ROPE.value, slots.stride(0), *strides)
        meta = _ws_meta(splits, switches)
    elif rows.dtype == torch.uint8:
        kernel, args = _sparse_mla_fp8_kernel, (*head, slots.stride(0), *strides)
    elif bk == 64 and (cfg["ws"] if cfg["ws"] is not None else
                       envs.DSASERVE_SPARSE_MLA_WS and splits == 1 and t >= WS_MIN_TOKENS):
        # the warp-specialised kernel (gluon_sparse_mla_ws.py), by default for unsplit prefill-sized calls only
        kernel, args = ws._sparse_mla_ws_kernel, (*head, DC.value, slots.stride(0), *strides)
        switches = cfg["ws_variant"] if cfg["ws_variant"] is not None else ws.DEFAULT_SWITCHES
        meta = _ws_meta(splits, ws.variant(switches))
    else:
        kernel, args = _sparse_mla_gluon_kernel, (*head, DC.value, slots.stride(0), *strides)
        meta["STAGES"] = cfg["num_stages"]
    return kernel, part, lse, (t, head_blocks, splits), args, meta


def sparse_mla_attention_gluon(q_nope: torch.Tensor, q_rope: torch.Tensor, rows: torch.Tensor,
                               topk_slots: torch.Tensor, softmax_scale: float, out: torch.Tensor,
                               config: dict | None = None) -> torch.Tensor:
    """`reference.sparse_mla_attention` at kv_lora 512, rope 64 into `out` [T, H, 512] over bf16 rows [slots, 576]
    (a prefill's staged rows, the bf16 cache) or the fp8_ds_mla cache's bytes [slots, 656] (the caller has
    checked the rest: `sparse_mla_attention` dispatches here). `config` (bench/tuning only)
    overrides DEFAULT: block_k, num_stages (bf16 rows, single-partition kernel), splits, ws (True / False: a
    warp-specialised kernel or not; over the fp8 cache True is the prefill schedule's, "dec" the decode schedule's,
    which None takes too), ws_variant (its switches)."""
    width = DC.value + DR.value if rows.dtype == torch.bfloat16 else FP8_ROW if rows.dtype == torch.uint8 else -1
    if rows.shape[-1] != width or q_nope.shape[-1] != DC.value:
        raise ValueError(f"sparse_mla_attention_gluon: bf16 rows of {DC.value + DR.value} or fp8_ds_mla bytes of "
                         f"{FP8_ROW}, and q_nope of {DC.value} channels; got {rows.dtype} rows of {rows.shape[-1]}, "
                         f"q_nope {q_nope.shape[-1]}")
    cfg = {**DEFAULT, **(config or {})}
    kernel, part, lse, grid, args, meta = launch_plan(q_nope, q_rope, rows, topk_slots, softmax_scale, out, cfg,
                                                      _sm_count(q_nope))
    kernel[grid](*args, **meta)
    tsm.combine_splits(part, lse, out)
    return out


def takes(layout: KVLayout, dc: int, dr: int, t: int, device: torch.device) -> bool:
    """Whether these kernels run a call: bf16 rows (a prefill's staged rows, the bf16 cache) or the fp8_ds_mla
    cache at kv_lora 512 and rope 64, from GLUON_MIN_TOKENS tokens, on sm_90 with Gluon, unless
    DSASERVE_SPARSE_MLA_GLUON is 0."""
    return (layout in (BF16, FP8_DS_MLA) and dc == DC.value and dr == DR.value and t >= GLUON_MIN_TOKENS
            and envs.DSASERVE_SPARSE_MLA_GLUON and available(device))


def sparse_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout | str,
                         topk_slots: torch.Tensor, softmax_scale: float, kv_lora_rank: int,
                         out: torch.Tensor | None = None, defer_combine: bool = False,
                         full_rows: bool = False) -> torch.Tensor:
    """The registry's sparse MLA: these kernels where `takes` says so (a step's token count is static under CUDA
    graphs, so each captured bucket keeps one kernel), else `triton_sparse_mla`'s (split-K flash-decoding for a
    few tokens, its tensor-core tiles for other latents and layouts)."""
    layout = get_kv_layout(layout, "sparse_mla_attention: layout")
    t, _, dc = q_nope.shape
    if dc != kv_lora_rank or t == 0 or not takes(layout, dc, q_rope.shape[-1], t, q_nope.device):
        return tsm.sparse_mla_attention(q_nope, q_rope, kv_cache, layout, topk_slots, softmax_scale, kv_lora_rank,
                                        out=out, defer_combine=defer_combine, full_rows=full_rows)
    rows = tsm.cache_views(kv_cache, layout, dc, DR.value)[0]
    return sparse_mla_attention_gluon(q_nope, q_rope, rows, topk_slots, softmax_scale, _out_buffer(q_nope, out))
