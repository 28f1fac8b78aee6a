"""Hopper sparse MLA over the fp8_ds_mla cache in FlashMLA's decode schedule (issue 17; request path stage 6,
attention): one token's 64 heads over its top-k rows (e4m3 nope, four FP32 scales, bf16 rope) at kv_lora 512, rope
64. The fp8 cache's default Gluon kernel (`gluon_sparse_mla.FP8_DEFAULT`): every call over the cache from 16
tokens, decode batches (measured at 16-128 tokens) and the prefill chunks that read the cache itself (those
`prefill_staging` does not stage; tested up to 1000 tokens, not timed).

Owns: `_sparse_mla_dec_fp8_kernel`, `DEC_REGS`, its switches (`SWITCHES`, `DEFAULT_SWITCHES`, `variant`).
Why a second warp-specialised fp8 kernel: `gluon_sparse_mla_ws_fp8` keeps the prefill schedule (both consumer
warpgroups compute S, 216 registers each), so its producer has 72 registers and stages each half block's bytes
through that half's own shared memory (cp.async, wait, shared load, dequant, store, one half in flight): at 128
tokens x 2048 keys it takes 171 us (213 TFLOP/s, graph-timed) where its consumers over bf16 rows take 102
(bench/RESULTS.md, twenty-second and twenty-third sessions). Here the three warpgroups split the work as
FlashMLA's sm90 sparse fp8 decode kernel does (DeepSeek's; written in Gluon here):
  WG0 (192 registers): for each 64-key block, S [64 heads, 64 keys] = Q K^T + Q_rope R^T (m64n64 wgmma from
      shared memory), the online softmax, P (bf16) and the block's rescale factors into shared memory for WG1,
      then O[:, 0:256] += P V[:, 0:256] with P from registers;
  WG1 (160): O[:, 256:512] += P V[:, 256:512], P from shared memory, after rescaling its O by WG0's factors;
  the producer (the default partition, 152: the rest of the register file) fetches a whole block (64 rows x 656
      bytes: 64 registers of e4m3 a thread, 16 of rope, the scales) into registers one block ahead of the buffer
      it fills, so the gather's latency passes while it waits for that buffer to be freed; then it dequantises
      into the block's bf16 buffer (two in shared memory), writes the slots' bias, fences, and arrives once.
The rows are loaded and held as 32-bit words: as bytes, each took a register of its own across the loop (offline
sm_90: 2.2 KB of spills, 1040 byte permutes), now 24 B. A word's four e4m3 become bf16 in inline PTX (e4m3 -> f16
-> f32, exact; times the row's FP32 scale; rounded once to bf16: the other fp8 kernels' rounding) and are stored
through word views of the bf16 buffers (the same 128-byte swizzle, the same bytes).
Shared memory is the ws kernels' (`gluon_sparse_mla_ws._setup`: Q 64 KB + Q_rope 8 + two key blocks 2 x 72 + P 8
and the fp8 ws kernel's 1 KB scale ring, unused here: 225.6 of 227 KB),
reused: m_s carries WG0's rescale factors, p1_s its P, bias_s the two buffers' slot bias. Numerics: bf16 operands,
fp32 accumulation, P rounded to bf16 once, as the other kernels; the softmax's maximum moves a block at a time
(the ws kernels move it a round of two), so outputs match theirs within rounding, not bit for bit. Row offsets
are 64-bit. No interpreter runs Gluon: CPU runs never reach this kernel; its device test compares it with the
reference, the single-partition fp8 kernel and the bf16 ws kernel over the dequantised rows.
"""

# (no `from __future__ import annotations`: Gluon reads the annotations)

from dsaserve.kernels.gluon_common import HAVE_GLUON
from dsaserve.kernels.gluon_sparse_mla_ws import P0 as P_READY  # the ws kernels' P exchange barriers, reused
from dsaserve.kernels.gluon_sparse_mla_ws import P1 as P_FREE
from dsaserve.kernels.gluon_sparse_mla_ws_fp8 import ROPE, SCALES  # byte offsets in an fp8_ds_mla row

# registers of WG0, WG1 (the kernel's warp_specialize list, a literal there: Gluon reads no tuple global) and the
# producer, the default partition, which gets the rest of 3 x 4 warps x 168 (the launch's maxnreg,
# `gluon_sparse_mla_ws.WS_MAXNREG`): 504 - 192 - 160 = 152, FlashMLA's split. bench/offline_ws_variants.py reads it.
DEC_REGS = (192, 160, 152)
# the switches launch_plan passes when a call names none (the H200, 128 tokens x 2048 keys from HBM, bench/RESULTS.md
# twenty-third session: 121.5 us against 134.6 without EARLY_ROWS): PIN (the wgmma descriptors of Q, Q_rope and P
# through an opaque per-block index, as the ws kernels) and EARLY_ROWS (the producer's slots loaded a block early)
DEFAULT_SWITCHES = {"PIN": True, "EARLY_ROWS": True}
SWITCHES = ("PIN", "EARLY_ROWS")  # the kernel's constexprs after SPLIT


def variant(switches: dict) -> dict:
    """The launch's constexprs for these switches; an unknown one is refused (ValueError)."""
    unknown = set(switches) - set(SWITCHES)
    if unknown:
        raise ValueError(f"gluon_sparse_mla_dec_fp8: unknown switches {sorted(unknown)}; known: {list(SWITCHES)}")
    return dict(switches)



if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from dsaserve.kernels.gluon_sparse_mla_ws import (
        BK,
        FREE,
        O_L,
        P_L,
        READY,
        S_L,
        _epilogue,
        _free,
        _pin,
        _s_left,
        _s_right,
        _setup,
        _slots,
    )

    # a block's 64 rows as 32-bit words (four e4m3 bytes, or two bf16): held as bytes, every byte took a register of
    # its own across the loop (offline sm_90: 2.2 KB of spills, 1040 byte permutes)
    GRP_L = gl.constexpr(gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0]))  # [64 rows, 32 words]: 16 B a load
    SW32 = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))
    # e4m3 x 4 (a word) times the row's FP32 scale -> bf16 x 4 (two words), each product rounded once to bf16: the
    # other fp8 kernels' rounding (e4m3 -> f16 and f16 -> f32 are exact)
    DEQUANT_ASM = gl.constexpr("""{
        .reg .b16 lo, hi, a0, a1, b0, b1;
        .reg .b32 a, b;
        .reg .f32 f0, f1, f2, f3;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {a0, a1}, a;
        mov.b32 {b0, b1}, b;
        cvt.f32.f16 f0, a0;
        cvt.f32.f16 f1, a1;
        cvt.f32.f16 f2, b0;
        cvt.f32.f16 f3, b1;
        mul.rn.f32 f0, f0, $3;
        mul.rn.f32 f1, f1, $3;
        mul.rn.f32 f2, f2, $3;
        mul.rn.f32 f3, f3, $3;
        cvt.rn.bf16x2.f32 $0, f1, f0;
        cvt.rn.bf16x2.f32 $1, f3, f2;
    }""")

    @gluon.jit
    def _n_blocks(a):
        return gl.maximum(gl.cdiv(a.k1 - a.k0, BK), 0).to(gl.int32)

    @gluon.jit
    def _bias(a):
        """bias_s [128] as the two buffers' [2, 64] slot bias (0 or -inf)."""
        return a.bias_s._reinterpret(gl.float32, [2, 64], a.bias_s.layout)  # (a layout may drop a leading dim)

    @gluon.jit
    def _fetch(a, sl):
        """The 64 rows of slots `sl` into registers as words: their e4m3 bytes as four 128-byte groups, each
        group's FP32 scale, the bf16 rope, and which rows are valid (zeros where not: a -1 slot)."""
        ok = sl >= 0
        rows = gl.where(ok, sl, 0).to(gl.int64) * a.stride_c
        words = a.c_ptr.to(gl.pointer_type(gl.int32)) + rows // 4  # 656-byte rows: word-aligned
        base = words[:, None] + gl.arange(0, 32, layout=gl.SliceLayout(0, GRP_L))[None, :]
        g0 = gl.load(base, mask=ok[:, None], other=0)
        g1 = gl.load(base + 32, mask=ok[:, None], other=0)
        g2 = gl.load(base + 64, mask=ok[:, None], other=0)
        g3 = gl.load(base + 96, mask=ok[:, None], other=0)
        rope = gl.load(base + ROPE // 4, mask=ok[:, None], other=0)  # 64 bf16: 32 words
        sptr = (words + SCALES // 4).to(gl.pointer_type(gl.float32))
        s0 = gl.load(sptr, mask=ok, other=0.0)
        s1 = gl.load(sptr + 1, mask=ok, other=0.0)
        s2 = gl.load(sptr + 2, mask=ok, other=0.0)
        s3 = gl.load(sptr + 3, mask=ok, other=0.0)
        return g0, g1, g2, g3, s0, s1, s2, s3, rope, ok

    @gluon.jit
    def _dequant_group(dst, g: gl.constexpr, raw, sc):
        """Words [64, 32] of group g (bf16 columns 128g:128g + 128) into the block's word view."""
        scale = gl.zeros([64, 32], gl.float32, layout=GRP_L) + sc[:, None]
        lo, hi = gl.inline_asm_elementwise(DEQUANT_ASM, "=r,=r,r,f", [raw, scale], dtype=(gl.int32, gl.int32),
                                           is_pure=True, pack=1)
        dst.slice(64 * g, 64, dim=1).store(gl.reshape(gl.join(lo, hi), [64, 64]))

    @gluon.jit
    def _put(a, b, g0, g1, g2, g3, s0, s1, s2, s3, rope, ok):
        """A fetched block into buffer b (bf16 nope, rope, slot bias), fenced for wgmma, one arrival on its ready
        barrier. The bf16 buffers are written through word views of the same 128-byte swizzle (the same bytes)."""
        dst = a.k_s._reinterpret(gl.int32, [2, 64, 256], SW32).index(b)
        _dequant_group(dst, 0, g0, s0)
        _dequant_group(dst, 1, g1, s1)
        _dequant_group(dst, 2, g2, s2)
        _dequant_group(dst, 3, g3, s3)
        a.r_s._reinterpret(gl.int32, [2, 64, 32], SW32).index(b).store(rope)
        _bias(a).index(b).store(gl.where(ok, 0.0, float("-inf")))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(a.bars.index(READY + b), count=1)

    @gluon.jit
    def _producer(a):
        """Block i into buffer i & 1 once both warpgroups freed it (block i - 2's use), from the registers its rows
        were fetched into while block i - 1 was put; block i + 1's fetch is issued right after. EARLY_ROWS: block
        i + 2's slots are loaded then too (a block early: their latency is off the path from a slot to its row's
        bytes)."""
        g0, g1, g2, g3, s0, s1, s2, s3, rope, ok = _fetch(a, _slots(a, a.k0, GRP_L))
        if a.EARLY_ROWS:
            nxt = _slots(a, a.k0 + BK, GRP_L)
        for i in range(_n_blocks(a)):
            b = i & 1
            ph = ((i >> 1) & 1) ^ 1  # a fresh mbarrier passes a wait on phase 1
            mbarrier.wait(a.bars.index(FREE + b), ph)
            mbarrier.wait(a.bars.index(FREE + 2 + b), ph)
            _put(a, b, g0, g1, g2, g3, s0, s1, s2, s3, rope, ok)
            if a.EARLY_ROWS:
                g0, g1, g2, g3, s0, s1, s2, s3, rope, ok = _fetch(a, nxt)
                nxt = _slots(a, a.k0 + (i + 2) * BK, GRP_L)
            else:
                g0, g1, g2, g3, s0, s1, s2, s3, rope, ok = _fetch(a, _slots(a, a.k0 + (i + 1) * BK, GRP_L))

    @gluon.jit
    def _wg0(a):
        """S, the softmax and P of every block; output columns 0:256."""
        m_i = gl.full([64], -1e30, gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, S_L))
        acc = gl.zeros([64, 256], gl.float32, layout=O_L)
        s_zero = gl.zeros([64, BK], gl.float32, layout=S_L)
        for i in range(_n_blocks(a)):
            b = i & 1
            mbarrier.wait(a.bars.index(READY + b), (i >> 1) & 1)
            s = _s_left(a, b, s_zero, False, _pin(a, a.q_s, i))
            s = _s_right(a, b, s, True, _pin(a, a.q_s, i), _pin(a, a.qr_s, i))
            s = warpgroup_mma_wait(num_outstanding=0, deps=[s])
            s = s * a.qk_scale + _bias(a).index(b).load(gl.SliceLayout(0, S_L))[None, :]
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            pb = p.to(gl.bfloat16)
            mbarrier.wait(a.bars.index(P_FREE), (i & 1) ^ 1)  # WG1 has read the last block's P and factor
            a.p1_s.store(pb)
            a.m_s.store(alpha)
            fence_async_shared()
            gl.thread_barrier()
            acc = warpgroup_mma(gl.convert_layout(pb, P_L), a.k_s.index(b).slice(0, 256, dim=1), acc,
                                is_async=True)
            mbarrier.arrive(a.bars.index(P_READY), count=1)
            # waited inside the block: an accumulator in flight across the loop's back edge makes ptxas serialise
            # every wgmma of the kernel (C7514, gluon_sparse_mla_ws)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _free(a, FREE + b)
        _epilogue(a, acc, m_i, l_i, 0)

    @gluon.jit
    def _wg1(a):
        """P V of every block with WG0's P; output columns 256:512."""
        acc = gl.zeros([64, 256], gl.float32, layout=O_L)
        for i in range(_n_blocks(a)):
            b = i & 1
            mbarrier.wait(a.bars.index(READY + b), (i >> 1) & 1)  # the block's rows, seen by this warpgroup too
            mbarrier.wait(a.bars.index(P_READY), i & 1)
            acc = acc * a.m_s.load(gl.SliceLayout(1, O_L))[:, None]
            acc = warpgroup_mma(_pin(a, a.p1_s, i), a.k_s.index(b).slice(256, 256, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _free(a, P_FREE)  # P and the factor read (the partition barrier in _free orders every thread's reads)
            mbarrier.arrive(a.bars.index(FREE + 2 + b), count=1)
        none = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, S_L))  # WG0's row sums are the sums
        _epilogue(a, acc, none, none, 1)

    @gluon.jit
    def _sparse_mla_dec_fp8_kernel(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, qk_scale,
                                   stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_c, r_off, stride_st,
                                   stride_os, stride_ot, stride_oh, stride_ls, stride_lt, SPLIT: gl.constexpr,
                                   PIN: gl.constexpr = False, EARLY_ROWS: gl.constexpr = False):
        """One token, 64 heads, one split of its top-k over fp8_ds_mla bytes (grid: tokens, head blocks, splits);
        launched with 4 warps (the producer) and `gluon_sparse_mla_ws.WS_MAXNREG`."""
        a, _, _ = _setup(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, qk_scale, stride_qnt,
                         stride_qnh, stride_qrt, stride_qrh, stride_c, r_off, stride_st, stride_os, stride_ot,
                         stride_oh, stride_ls, stride_lt, SPLIT, 0, False, EARLY_ROWS, 0, PIN, True)
        gl.warp_specialize([(_producer, (a,)), (_wg0, (a,)), (_wg1, (a,))], [4, 4], [192, 160])
