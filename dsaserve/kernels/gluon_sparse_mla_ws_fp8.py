"""Hopper sparse MLA over the fp8_ds_mla cache, warp-specialised (issue 17; request path stage 6, attention): the
cache's 656-byte rows (e4m3 nope, four FP32 scales, bf16 rope) at kv_lora 512, rope 64, without a staging pass.
Kept for the A/B, not the default: `gluon_sparse_mla.launch_plan` takes it when a call's cfg "ws" is True.

Owns: `_sparse_mla_ws_fp8_kernel`, `DEFAULT_SWITCHES`. Its two consumer warpgroups are `gluon_sparse_mla_ws`'s,
unchanged (they read bf16 key blocks from shared memory and never see the fp8 bytes); only the producer differs.
Why it was written: the single-partition fp8 kernel (`gluon_sparse_mla._sparse_mla_fp8_kernel`) spends ~5 us on
each 64-key block of a decode batch on the H200 (bench/sweep_decode_splits.py), 3-4x the bf16 warp-specialised
kernel's pace over L2-resident staged rows, and its loads share warps with S and the softmax. What the H200 showed
(bench/RESULTS.md, thirteenth session): this kernel is also at ~5 us a block (0.91-0.95x the other's time at
128-256 tokens over a 1.4 GB pool, even in the slice's batch-128 step), so the bound is the gather of random rows
from HBM, not where the loads are issued. Here the producer warpgroup (the default partition) does it beside them:
  issue (a half of a block: nope columns 0:256 = L or 256:512 + rope = R): wait for the half to be free, cp.async
      its rows' 256 e4m3 bytes into the half's second 128-column group of the bf16 buffer (16 KB: exactly its bf16
      bytes' size), the half's two groups of scales into a 2-slot ring (512 B a slot; the kernel uses all but
      ~0.4 KB of the 227 KB) and, for R, the rope rows straight into the block's rope buffer; one commit group;
  dequant (the previous half, while the issued one is in flight): wait for its copies, then the first 128-column
      group from the staged bytes into its own columns, then the second over the staged bytes themselves (every
      thread holds its bytes in registers before the barrier that lets any overwrite them), the FP32 product rounded
      once to bf16 as the other fp8 kernels round it; fenced for wgmma; one arrival on the half's ready barrier.
The halves are produced in the order WG1-L, WG0-L, WG0-R, WG1-R each round, each issue one half ahead of its
dequant: an order in which no issue waits for a half that the consumers free only after the half being
dequantised (WG0-L of round r + 1 is freed after WG1-R of round r is used; WG1-L after WG0's halves of the
round before). The bf16 buffers are an int8 allocation [8, 16 KB] (4 x block + 2 x half + group) reinterpreted as
the bf16 [2, 64, 512] view: its 128-byte-swizzled layout stores each 64 columns of all 64 rows contiguously (8 KB),
so a 128-column group is one 16 KB slot.
Row offsets are 64-bit. No interpreter runs Gluon: CPU runs never reach this kernel; its device test compares it
with the reference and the single-partition fp8 kernel.
"""

# (no `from __future__ import annotations`: Gluon reads the annotations)
import triton.language as tl

from dsaserve.kernels.gluon_common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

    from dsaserve.kernels.gluon_sparse_mla_ws import BK, FREE, READY, VALID, _buffers, _prefetch_l2, _setup, _wg0, _wg1

# the switches launch_plan passes when a call names none: PIN (0 spills offline; without it 250 vs 188 us at 128
# tokens x 2048 keys on the H200) and rows one round ahead into L2 (180 vs 188 us; 2 and 4 rounds slower)
DEFAULT_SWITCHES = {"PIN": True, "L2_AHEAD": 1}
SCALES = tl.constexpr(512)  # byte offsets in an fp8_ds_mla row: the four FP32 scales, then the bf16 rope
ROPE = tl.constexpr(528)

if HAVE_GLUON:

    @gluon.jit
    def _slot_rows(a, start, lay: gl.constexpr, dim: gl.constexpr):
        """(byte offsets, valid) of the rows of slots [start, start + 64) along dimension `dim` of `lay`."""
        offs = start + gl.arange(0, BK, layout=gl.SliceLayout(1 - dim, lay))
        sl = gl.load(a.slots + offs, mask=offs < a.k1, other=-1)
        return gl.where(sl >= 0, sl, 0).to(gl.int64) * a.stride_c, sl >= 0

    @gluon.jit
    def _staged(kb, b, half: gl.constexpr):
        """The staging bytes of block b's half: its second 128-column group's bf16 space, as [64 rows, 256] u8."""
        return kb.index(4 * b + 2 * half + 1)._reinterpret(gl.uint8, [64, 256],
                                                           gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))

    @gluon.jit
    def _issue(a, kb, sc_s, b, half: gl.constexpr, w: gl.constexpr, start, ph, slot: gl.constexpr):
        """Wait for block b's half to be free; cp.async its e4m3 bytes (staging), its two scale groups (ring slot
        `slot`, a group's 64 scales contiguous) and for R its rope rows; commit them as one group. For warpgroup
        w's first half (L of WG0's block, R of WG1's): the block's slot bias, as `gluon_sparse_mla_ws._fill_rows`."""
        mbarrier.wait(a.bars.index(FREE + 2 * half + b), ph)
        raw_l: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [4, 1], [1, 0])  # 16 B a copy
        rows, ok = _slot_rows(a, start, raw_l, 0)
        cols = 256 * half + gl.arange(0, 256, layout=gl.SliceLayout(0, raw_l))
        async_copy.async_copy_global_to_shared(_staged(kb, b, half), a.c_ptr + rows[:, None] + cols[None, :],
                                               mask=ok[:, None])
        sc_l: gl.constexpr = gl.BlockedLayout([1, 1], [32, 1], [2, 2], [1, 0])  # [64 rows, 2 warps]: 4 B a copy
        srows, sok = _slot_rows(a, start, sc_l, 0)
        sptr = (a.c_ptr + srows + SCALES).to(gl.pointer_type(gl.float32))
        for j in gl.static_range(2):  # a group's 64 scales contiguous (each copied by two threads)
            async_copy.async_copy_global_to_shared(sc_s.index(2 * slot + j), sptr + 2 * half + j, mask=sok)
        if half == 1:
            rope_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            rrows, rok = _slot_rows(a, start, rope_l, 0)
            rptr = (a.c_ptr + rrows + ROPE).to(gl.pointer_type(gl.bfloat16))
            rcols = gl.arange(0, 64, layout=gl.SliceLayout(0, rope_l))
            async_copy.async_copy_global_to_shared(a.r_s.index(b), rptr[:, None] + rcols[None, :], mask=rok[:, None])
        async_copy.commit_group()
        if half == w:
            a.bias_s.slice(64 * w, 64).store(gl.where(ok, 0.0, float("-inf")))
            gl.thread_barrier()
            mbarrier.arrive(a.bars.index(VALID + w), count=1)

    @gluon.jit
    def _dequant(a, kb, sc_s, b, half: gl.constexpr, slot: gl.constexpr, pending: gl.constexpr):
        """Block b's half into bf16 from its staged bytes (all but `pending` later copy groups landed), then one
        arrival on its ready barrier."""
        async_copy.wait_group(pending)
        gl.thread_barrier()  # every producer thread's copies of this half have landed
        dq: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [4, 1], [1, 0])  # [64, 128] bytes, 16 a load
        staged = _staged(kb, b, half)
        dst = a.k_s.index(b)
        for j in gl.static_range(2):
            raw = staged.slice(128 * j, 128, dim=1).load(dq)
            sc = sc_s.index(2 * slot + j).load(gl.SliceLayout(1, dq))
            if j == 1:
                gl.thread_barrier()  # the second group's bytes are in every thread's registers: now overwritten
            v = (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc[:, None]).to(gl.bfloat16)
            dst.slice(256 * half + 128 * j, 128, dim=1).store(v)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(a.bars.index(READY + 2 * half + b), count=1)

    @gluon.jit
    def _producer(a, kb, sc_s):
        """Each round: WG1's L, WG0's L, WG0's R, WG1's R, each issued one half ahead of its dequant (the module
        docstring says why this order); ring slots alternate 0, 1, 0, 1. L2_AHEAD: the rows of the round that far
        ahead are prefetched into L2 at the start of each round (a decode batch's rows come from HBM: the cp.async
        of a half then waits on L2, not on HBM)."""
        if a.L2_AHEAD > 0:
            for d in gl.static_range(0, a.L2_AHEAD):  # the first rounds
                _prefetch_l2(a, a.k0 + 2 * d * BK, 656)
        for r in range(a.n_rounds):
            ph = (r & 1) ^ 1  # a fresh mbarrier passes a wait on phase 1
            start = a.k0 + 2 * r * BK
            b0, b1 = _buffers(a, r)
            if a.L2_AHEAD > 0:
                _prefetch_l2(a, start + 2 * a.L2_AHEAD * BK, 656)
            _issue(a, kb, sc_s, b1, 0, 1, start + BK, ph, 0)
            if r > 0:
                _dequant(a, kb, sc_s, b0, 1, 1, 1)  # last round's WG1 R: its buffer is this round's b0
            _issue(a, kb, sc_s, b0, 0, 0, start, ph, 1)
            _dequant(a, kb, sc_s, b1, 0, 0, 1)
            _issue(a, kb, sc_s, b0, 1, 0, start, ph, 0)
            _dequant(a, kb, sc_s, b0, 0, 1, 1)
            _issue(a, kb, sc_s, b1, 1, 1, start + BK, ph, 1)
            _dequant(a, kb, sc_s, b0, 1, 0, 1)
        if a.n_rounds > 0:
            _dequant(a, kb, sc_s, 1 - (a.n_rounds - 1) % 2, 1, 1, 0)

    @gluon.jit
    def _sparse_mla_ws_fp8_kernel(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, qk_scale,
                                  stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_c, r_off, stride_st,
                                  stride_os, stride_ot, stride_oh, stride_ls, stride_lt, SPLIT: gl.constexpr,
                                  PIN: gl.constexpr = False, L2_AHEAD: gl.constexpr = 0):
        """One token, 64 heads, one split of its top-k over fp8_ds_mla bytes (grid: tokens, head blocks, splits);
        launched as `gluon_sparse_mla_ws._sparse_mla_ws_kernel` is (4 warps, WS_MAXNREG). PIN: its switch; L2_AHEAD:
        rounds of rows prefetched into L2 ahead (0: none)."""
        a, kb, sc_s = _setup(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, qk_scale, stride_qnt,
                             stride_qnh, stride_qrt, stride_qrh, stride_c, r_off, stride_st, stride_os, stride_ot,
                             stride_oh, stride_ls, stride_lt, SPLIT, 0, False, False, L2_AHEAD, PIN, True)
        gl.warp_specialize([(_producer, (a, kb, sc_s)), (_wg0, (a,)), (_wg1, (a,))], [4, 4], [216, 216])
