"""Hopper sparse MLA over bf16 rows, warp-specialised (issue 17; request path stage 6, attention): a prefill's
staged rows and the bf16 cache at kv_lora 512, rope 64, for many tokens.

Owns: `_sparse_mla_ws_kernel` (launched through `gluon_sparse_mla.launch_plan`), `WS_MAXNREG`, its A/B switches
(`VARIANTS`, `variant`, `DEFAULT_SWITCHES`, the combinations the device runs: `CANDIDATES`), `_setup`; its prologue
helpers are gluon_common's.
The schedule is FlashMLA's sm90 sparse prefill (DeepSeek's; the same per-program problem as ours: one token, 64
heads, top-k key rows of 576), written in Gluon's warp specialisation. A program runs three warpgroups:
  WG0 and WG1 (worker partitions) each own half of the output columns (O [64, 256] fp32 in registers) and,
  per round of two 64-key blocks, one block each: S [64 heads, 64 keys] = Q K^T + Q_rope R^T as m64n64 wgmma
  (the single-partition kernel in gluon_sparse_mla.py splits a 64-key S over both warpgroups: m64n32, which the
  shared-memory port bounds below the tensor cores' rate), softmax, then O += P V twice: its own P from registers
  (wgmma A in registers) over its block, and the other warpgroup's P from shared memory over the other block.
  The row maxima go WG0 -> WG1 -> WG0 through shared memory, so both blocks of a round share WG1's maximum:
  WG0 rescales its P (for WG1) and its O once WG1's maximum is known.
  The producer warpgroup (the default partition, 72 registers) gathers the key rows with cp.async into two block
  buffers, each in two halves (nope dims 0:256 = "L", read by WG0's P V; nope 256:512 + rope = "R", read by
  WG1's), refilling a half as soon as both warpgroups are done with it (mbarriers; cp.async arrives on them). The
  buffers swap roles every round (WG0 takes buffer r & 1): the descriptors then follow a runtime index, which kept
  ptxas from spilling one consumer's hoisted wgmma descriptors (300 -> 212 B of spills, offline sm_90 compile).
WG0's buffer's rope rows are dead once WG0's S is done: they hold WG0's P for WG1 (FlashMLA's trick; it keeps
shared memory at 224 KB: Q 72 + two blocks 2 x 72 + WG1's P 8). Every wgmma is waited for inside its round: an
accumulator left in flight across the loop's back edge made ptxas serialise every wgmma of the kernel (C7514).
Numerics are the single-partition kernel's: bf16 operands, fp32 accumulation, P rounded to bf16 once (WG0's P
for WG1 rounded after its rescale to the round's maximum).
The switches (constexprs, launch_plan's cfg["ws_variant"]; each constexpr default is the schedule above, whose
sm_90 SASS they leave byte-identical offline) try what a review left open: P1 stored before its wgmma, fixed buffer
roles, descriptors kept from being hoisted and spilled (PIN: none spilled), the producer's slots read a round ahead
and L2 prefetch of later rounds' rows (the gather-bound long contexts); shared memory has no room for a third
block. What runs by default is DEFAULT_SWITCHES (measured fastest on the H200): fixed roles (WG0 buffer 0, WG1
buffer 1, through an opaque zero so nothing is hoisted), PIN and P1 stored before its wgmma. `_setup` is also the
prologue of `gluon_sparse_mla_ws_fp8` (the same consumers over the fp8 cache) and `gluon_sparse_mla_dec_fp8` (the
decode schedule over it); the latter reuses the consumers' wgmma helpers and epilogue too.
Row offsets are 64-bit. No interpreter runs Gluon: CPU runs never reach this kernel; its device test compares it
with the reference and the single-partition kernel.
"""

# (no `from __future__ import annotations`: the aggregate's field annotations must stay types)
import triton.language as tl

from dsaserve.kernels.gluon_common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.language.core import _aggregate as aggregate

    from dsaserve.kernels.gluon_common import _key_range, _load_q

# 12 warps x 32 threads x 168 registers fill the register file (65,536); the partitions then take 216 (WG0), 216
# (WG1: warp_specialize's list) and 72 (the producer, the default partition: the leftover) by setmaxnreg,
# FlashMLA's split: O (128) + S (32) + P fit in 216. (A consumer as the default partition spilled its wgmma
# descriptors: offline sm_90 compile.)
WS_MAXNREG = 168
# the kernel's A/B switches (constexprs; the defaults are the schedule above) and what each tests on the device:
#   P1_MODE: 0 WG1 stores its P to shared memory from the registers its in-flight P1 V1R wgmma reads as A (PTX
#     leaves reading them undefined; ptxas takes it), 1 stores it before issuing that wgmma from registers, 2 stores
#     it first and issues the wgmma from shared memory (A never in registers while in flight)
#   FIXED_ROLES: WG0 always takes buffer 0, WG1 buffer 1 (not swapped every round): each warpgroup's first half of
#     a round is then freed mid-round before, not at its end (no full gather latency at a round's start)
#   EARLY_ROWS: the producer reads a round's slots a round ahead (off the FREE wait -> cp.async path)
#   L2_AHEAD: the producer prefetches the rows of the round that many ahead into L2 (0: none)
#   PIN: Q's, Q_rope's and WG1's P buffer's descriptors through an opaque per-round index (not hoisted, not spilled)
VARIANTS = {"P1_MODE": 0, "FIXED_ROLES": False, "EARLY_ROWS": False, "L2_AHEAD": 0, "PIN": False}
# what launch_plan passes when a call names none: the H200 A/B of 2026-12-01 (bench_prefill_staging --ws-variants,
# bench/RESULTS.md, thirteenth session) found pin-fixed-p1-first the fastest or within 3 % of it on every case,
# 1.18-1.54x today's schedule (469-501 TFLOP/s; 4096 tokens x 32K context 305 -> 470); P1_MODE 1 also ends
# reading an in-flight wgmma's A registers
DEFAULT_SWITCHES = {"PIN": True, "FIXED_ROLES": True, "P1_MODE": 1}
# the combinations the device A/B runs (bench/bench_prefill_staging.py --ws-variants, the device test); "ws" is
# today's schedule. Offline sm_90 spills (WG0 / WG1 local bytes) in the comments
_PIN_FIXED = {"PIN": True, "FIXED_ROLES": True}
CANDIDATES = {
    "ws": {},  # 16 / 172 B: the schedule before DEFAULT_SWITCHES
    "p1-first": {"P1_MODE": 1},  # 16 / 176
    "fixed": {"FIXED_ROLES": True},  # 0 / 144
    "pin": {"PIN": True},  # 0 / 0 (so every pin-* below)
    "pin-p1-first": {"PIN": True, "P1_MODE": 1},
    "pin-p1-smem": {"PIN": True, "P1_MODE": 2},
    "pin-fixed": _PIN_FIXED,
    "pin-fixed-p1-first": {**_PIN_FIXED, "P1_MODE": 1},
    "early-rows": {"EARLY_ROWS": True},  # the producer's changes alone: the consumers' code is the default's
    "l2-ahead1": {"L2_AHEAD": 1},
    "l2-ahead2": {"L2_AHEAD": 2},
    "pin-early-l2": {"PIN": True, "EARLY_ROWS": True, "L2_AHEAD": 1},
    "all": {**_PIN_FIXED, "P1_MODE": 1, "EARLY_ROWS": True, "L2_AHEAD": 1},
}


def variant(switches: dict | None) -> dict:
    """The launch's constexprs for these switches: only the ones given (a default launch passes none)."""
    switches = dict(switches or {})
    unknown = set(switches) - set(VARIANTS)
    if unknown:
        raise ValueError(f"gluon_sparse_mla_ws: unknown switches {sorted(unknown)}; known: {sorted(VARIANTS)}")
    return switches
BK = tl.constexpr(64)  # keys a block; a round is two blocks, one a warpgroup
# mbarrier indices: ready (producer -> consumers; 128 cp.async arrivals) and free (consumers -> producer) of each
# block's halves, at READY + 2 * half + block (half 0 = L, 1 = R), and the exchange between the two warpgroups
# (row maxima, P, the final row sums)
READY, FREE = tl.constexpr(0), tl.constexpr(4)
MAX0, MAX1, P0, P1, SUM0 = (tl.constexpr(i) for i in range(8, 13))  # SUM0 + 1: WG1's row sums
VALID = tl.constexpr(14)  # + block: the producer wrote the block's slot bias
N_BARS = tl.constexpr(16)

if HAVE_GLUON:

    class _Args:
        """What every partition reads: shared memory, barriers, the program's token / split and its key range."""
        q_s: gl.shared_memory_descriptor
        qr_s: gl.shared_memory_descriptor
        k_s: gl.shared_memory_descriptor
        r_s: gl.shared_memory_descriptor
        p1_s: gl.shared_memory_descriptor
        m_s: gl.shared_memory_descriptor
        l_s: gl.shared_memory_descriptor
        bias_s: gl.shared_memory_descriptor
        bars: gl.shared_memory_descriptor
        c_ptr: gl.tensor
        slots: gl.tensor
        out: gl.tensor
        lse: gl.tensor
        k0: gl.tensor
        k1: gl.tensor
        n_rounds: gl.tensor
        qk_scale: gl.tensor
        stride_c: gl.tensor
        r_off: gl.tensor
        h0: gl.tensor
        n_heads: gl.tensor
        stride_oh: gl.tensor
        SPLIT: gl.constexpr
        P1_MODE: gl.constexpr
        FIXED_ROLES: gl.constexpr
        EARLY_ROWS: gl.constexpr
        L2_AHEAD: gl.constexpr
        PIN: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, *values):  # the fields in their annotations' order
            for name, value in zip(_ARG_FIELDS, values, strict=True):
                setattr(self, name, gl.constexpr(value) if name.isupper() else value)

    _ARG_FIELDS = tuple(_Args.__annotations__)
    _Args = aggregate(_Args)

    # one warpgroup's layouts: S [64 heads, 64 keys] and O [64 heads, 256 columns] of wgmma, P as its register A
    S_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16]))
    O_L = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16]))
    P_L = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=O_L.value, k_width=2))

    @gluon.jit
    def _scaled_scores(a, s, b: gl.constexpr, ph):
        """S in log2 units (qk_scale carries log2(e)), -inf on block b's empty slots (the producer's bias)."""
        mbarrier.wait(a.bars.index(VALID + b), ph)
        bias = a.bias_s.slice(64 * b, 64).load(gl.SliceLayout(0, S_L))
        return s * a.qk_scale + bias[None, :]

    @gluon.jit
    def _s_left(a, b, s, use_acc: gl.constexpr, q_s):
        """S += Q[:, 0:256] K_b[:, 0:256]^T, issued."""
        kt = a.k_s.index(b)
        return warpgroup_mma(q_s.slice(0, 256, dim=1), kt.slice(0, 256, dim=1).permute((1, 0)), s,
                             use_acc=use_acc, is_async=True)

    @gluon.jit
    def _s_right(a, b, s, use_acc: gl.constexpr, q_s, qr_s):
        """S += Q[:, 256:512] K_b[:, 256:512]^T + Q_rope R_b^T, issued."""
        kt = a.k_s.index(b)
        s = warpgroup_mma(q_s.slice(256, 256, dim=1), kt.slice(256, 256, dim=1).permute((1, 0)), s,
                          use_acc=use_acc, is_async=True)
        return warpgroup_mma(qr_s, a.r_s.index(b).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _publish(a, smem, value, bar: gl.constexpr, to_async: gl.constexpr):
        """`value` into `smem` by the whole warpgroup, then one arrival on `bar` (fenced for wgmma readers)."""
        smem.store(value)
        if to_async:
            fence_async_shared()
        gl.thread_barrier()  # this partition's warps only
        mbarrier.arrive(a.bars.index(bar), count=1)

    @gluon.jit
    def _epilogue(a, acc, m_i, l_i, wg: gl.constexpr):
        """Both warpgroups' row sums added (through shared memory), O / l into this warpgroup's 256 columns, and
        the log-sum-exp (by WG0) when split."""
        _publish(a, a.l_s.slice(64 * wg, 64), l_i, SUM0 + wg, False)
        mbarrier.wait(a.bars.index(SUM0 + 1 - wg), 0)
        l_tot = l_i + a.l_s.slice(64 - 64 * wg, 64).load(l_i.type.layout)
        inv = gl.convert_layout(gl.where(l_tot > 0, 1.0 / gl.maximum(l_tot, 1e-30), 0.0), gl.SliceLayout(1, O_L))
        h = a.h0 + gl.arange(0, 64, layout=gl.SliceLayout(1, O_L)).to(gl.int64)
        cols = wg * 256 + gl.arange(0, 256, layout=gl.SliceLayout(0, O_L))
        ptrs = a.out + h[:, None] * a.stride_oh + cols[None, :]
        gl.store(ptrs, (acc * inv[:, None]).to(a.out.dtype.element_ty), mask=(h < a.n_heads)[:, None])
        if a.SPLIT and wg == 0:
            lse = gl.where(l_tot > 0, m_i + gl.log2(gl.maximum(l_tot, 1e-30)), float("-inf"))
            hs = a.h0 + gl.arange(0, 64, layout=l_i.type.layout).to(gl.int64)
            gl.store(a.lse + hs, lse, mask=hs < a.n_heads)

    @gluon.jit
    def _buffers(a, r):
        """(WG0's buffer, WG1's buffer) of round r: swapped every round (r & 1), or fixed (0, 1) through an opaque
        per-round zero (FIXED_ROLES; as constants the wgmma descriptors were hoisted out of the loop and spilled:
        376 B, offline sm_90 compile)."""
        if a.FIXED_ROLES:
            b0 = _opaque_zero(r)
        else:
            b0 = r & 1
        return b0, 1 - b0

    @gluon.jit
    def _opaque_zero(r):
        """0, computed from r in a way the compilers cannot fold: what is indexed by it is not loop invariant."""
        return gl.inline_asm_elementwise("and.b32 $0, $1, 0;", "=r,r", [r], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _pin(a, smem, r):
        """`smem` itself, through an opaque per-round index when PIN (its wgmma descriptors then are not hoisted out
        of the round loop, where ptxas spills them)."""
        if a.PIN:
            smem = smem._reinterpret(smem.dtype, [1, smem.shape[0], smem.shape[1]], smem.layout).index(
                _opaque_zero(r))
        return smem

    @gluon.jit
    def _free(a, bar):
        """One arrival on a FREE barrier once this warpgroup's reads of the half are done (its wgmma waited for).
        The arrival is one thread's, so every thread's wgmma wait must be passed first: the partition barrier is
        explicit. (Triton 3.6's membar pass inserts the same bar.sync before an mbarrier.arrive that follows
        unsynchronised shared-memory accesses, and none after this one: sm_90 SASS identical offline.)"""
        gl.thread_barrier()
        mbarrier.arrive(a.bars.index(bar), count=1)

    @gluon.jit
    def _wg0(a):
        """Block 2r of each round (in buffer r & 1, or 0 with FIXED_ROLES); owns output columns 0:256 (V's "L"
        half of both blocks)."""
        m_i = gl.full([64], -1e30, gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, S_L))
        acc = gl.zeros([64, 256], gl.float32, layout=O_L)
        s_zero = gl.zeros([64, BK], gl.float32, layout=S_L)
        for r in range(a.n_rounds):
            ph = r & 1
            b0, b1 = _buffers(a, r)  # this round's buffer and WG1's (swapped: last round's WG1 buffer is this one)
            mbarrier.wait(a.bars.index(READY + b0), ph)
            fence_async_shared()
            s = _s_left(a, b0, s_zero, False, _pin(a, a.q_s, r))
            mbarrier.wait(a.bars.index(READY + 2 + b0), ph)
            fence_async_shared()
            s = _s_right(a, b0, s, True, _pin(a, a.q_s, r), _pin(a, a.qr_s, r))
            s = _scaled_scores(a, warpgroup_mma_wait(num_outstanding=0, deps=[s]), 0, ph)
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            _publish(a, a.m_s, m_new, MAX0, False)
            acc = warpgroup_mma(gl.convert_layout(p.to(gl.bfloat16), P_L), a.k_s.index(b0).slice(0, 256, dim=1),
                                acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _free(a, FREE + b0)
            mbarrier.wait(a.bars.index(MAX1), ph)
            m_i = a.m_s.load(m_new.type.layout)  # WG1's maximum: the round's
            sf = gl.exp2(m_new - m_i)
            # P0 rescaled to the round's maximum into this buffer's rope rows (dead after S) for WG1
            _publish(a, a.r_s.index(b0), (p * sf[:, None]).to(gl.bfloat16), P0, True)
            mbarrier.wait(a.bars.index(P1), ph)
            acc = acc * gl.convert_layout(sf, gl.SliceLayout(1, O_L))[:, None]
            l_i = l_i * sf
            acc = warpgroup_mma(_pin(a, a.p1_s, r), a.k_s.index(b1).slice(0, 256, dim=1), acc, is_async=True)
            # waited here, not under the next S: an accumulator in flight across the loop's back edge makes ptxas
            # serialise every wgmma of the kernel (C7514)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _free(a, FREE + b1)  # WG1's L half: read by both warpgroups
        _epilogue(a, acc, m_i, l_i, 0)

    @gluon.jit
    def _wg1(a):
        """Block 2r + 1 of each round (in the other buffer); owns output columns 256:512 (V's "R" halves)."""
        m_i = gl.full([64], -1e30, gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([64], gl.float32, layout=gl.SliceLayout(1, S_L))
        acc = gl.zeros([64, 256], gl.float32, layout=O_L)  # each round ends with its MMAs waited for
        s_zero = gl.zeros([64, BK], gl.float32, layout=S_L)
        for r in range(a.n_rounds):
            ph = r & 1
            b0, b1 = _buffers(a, r)  # WG0's buffer this round, this warpgroup's
            mbarrier.wait(a.bars.index(READY + 2 + b1), ph)
            fence_async_shared()
            s = _s_right(a, b1, s_zero, False, _pin(a, a.q_s, r), _pin(a, a.qr_s, r))
            mbarrier.wait(a.bars.index(READY + b1), ph)
            fence_async_shared()
            s = _s_left(a, b1, s, True, _pin(a, a.q_s, r))
            s = _scaled_scores(a, warpgroup_mma_wait(num_outstanding=0, deps=[s]), 1, ph)
            mbarrier.wait(a.bars.index(MAX0), ph)
            m_new = gl.maximum(a.m_s.load(m_i.type.layout), gl.max(s, axis=1))  # >= WG0's, >= this WG's last
            gl.thread_barrier()  # every thread has read WG0's maximum before it is overwritten
            alpha = gl.exp2(m_i - m_new)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
            p = gl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + gl.sum(p, axis=1)
            m_i = m_new
            _publish(a, a.m_s, m_new, MAX1, False)
            pb = p.to(gl.bfloat16)
            if a.P1_MODE == 0:  # P1 V1R issued from registers, then P1 stored from them while it is in flight
                acc = warpgroup_mma(gl.convert_layout(pb, P_L), a.k_s.index(b1).slice(256, 256, dim=1), acc,
                                    is_async=True)
            # WG0's P1 V1L of the last round is done: WG0 published MAX0 after it
            a.p1_s.store(pb)
            fence_async_shared()
            gl.thread_barrier()
            if a.P1_MODE == 1:  # stored first, then issued from registers
                acc = warpgroup_mma(gl.convert_layout(pb, P_L), a.k_s.index(b1).slice(256, 256, dim=1), acc,
                                    is_async=True)
            elif a.P1_MODE == 2:  # stored first, issued from shared memory (no register A in flight)
                acc = warpgroup_mma(_pin(a, a.p1_s, r), a.k_s.index(b1).slice(256, 256, dim=1), acc,
                                    is_async=True)
            mbarrier.wait(a.bars.index(P0), ph)
            acc = warpgroup_mma(a.r_s.index(b0), a.k_s.index(b0).slice(256, 256, dim=1), acc, is_async=True)
            mbarrier.arrive(a.bars.index(P1), count=1)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=[acc])
            _free(a, FREE + 2 + b1)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            _free(a, FREE + 2 + b0)  # also frees WG0's rope rows (P0)
        _epilogue(a, acc, m_i, l_i, 1)

    @gluon.jit
    def _gather(a, rows, ok, dst, col0: gl.constexpr, lay: gl.constexpr):
        """cp.async of the rows' bf16 columns [col0, col0 + dst's width) into dst (zeros where not ok)."""
        cols = col0 + gl.arange(0, dst.shape[1], layout=gl.SliceLayout(0, lay))
        async_copy.async_copy_global_to_shared(dst, a.c_ptr + rows[:, None] + cols[None, :], mask=ok[:, None])

    @gluon.jit
    def _slots(a, start, lay: gl.constexpr):
        """The slots [start, start + 64) along `lay`'s rows (-1 past k1)."""
        offs = start + gl.arange(0, BK, layout=gl.SliceLayout(1, lay))
        return gl.load(a.slots + offs, mask=offs < a.k1, other=-1)

    @gluon.jit
    def _rows(a, start, lay: gl.constexpr):
        """(element offsets, valid) of the rows of slots [start, start + 64) along `lay`'s rows."""
        sl = _slots(a, start, lay)
        return gl.where(sl >= 0, sl, 0).to(gl.int64) * a.stride_c, sl >= 0

    @gluon.jit
    def _fill_rows(a, b, w: gl.constexpr, rows, ok, half: gl.constexpr, lay: gl.constexpr):
        """Gather block b's half (0: L, 1: R) of these rows, arrive on its ready barrier when the copies land."""
        _gather(a, rows, ok, a.k_s.index(b).slice(256 * half, 256, dim=1), 256 * half, lay)
        if half == 1:
            _gather(a, rows + a.r_off, ok, a.r_s.index(b), 0, lay)
        async_copy.mbarrier_arrive(a.bars.index(READY + 2 * half + b), increment_count=False)
        if half == w:  # warpgroup w's block, the half its S starts on: its slots' bias, once a round (free: the
            # warpgroup read its last bias in its softmax, before the half this waited for was freed)
            a.bias_s.slice(64 * w, 64).store(gl.where(ok, 0.0, float("-inf")))
            gl.thread_barrier()
            mbarrier.arrive(a.bars.index(VALID + w), count=1)

    @gluon.jit
    def _fill(a, b, w: gl.constexpr, start, half: gl.constexpr, ph, lay: gl.constexpr):
        """Wait for block b's half to be free, then read its slots and gather it."""
        mbarrier.wait(a.bars.index(FREE + 2 * half + b), ph)
        rows, ok = _rows(a, start, lay)
        _fill_rows(a, b, w, rows, ok, half, lay)

    @gluon.jit
    def _fill_early(a, b, w: gl.constexpr, sl, half: gl.constexpr, ph, lay: gl.constexpr):
        """Wait for block b's half to be free and gather it from slots read a round earlier (EARLY_ROWS)."""
        mbarrier.wait(a.bars.index(FREE + 2 * half + b), ph)
        _fill_rows(a, b, w, gl.where(sl >= 0, sl, 0).to(gl.int64) * a.stride_c, sl >= 0, half, lay)

    @gluon.jit
    def _prefetch_l2(a, start, ROW_BYTES: gl.constexpr):
        """L2 prefetch (cp.async.bulk.prefetch, a whole row: 1152 B of bf16 nope then rope, or an fp8_ds_mla row's
        656) of the 128 rows of the round from slot `start`: a producer thread a row, no shared memory, nothing
        waited for (L2_AHEAD)."""
        pl: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        offs = start + gl.arange(0, 2 * BK, layout=pl)
        sl = gl.load(a.slots + offs, mask=offs < a.k1, other=-1)
        ptr = a.c_ptr + gl.where(sl >= 0, sl, 0).to(gl.int64) * a.stride_c
        size = gl.full([2 * BK], ROW_BYTES, gl.int32, layout=pl)
        gl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ge.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.b32 $0, 0; }",
            "=r,l,r,r", [ptr, sl, size], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _producer(a):
        """Each round's two blocks, in the order the warpgroups start on them: WG0 begins S on its block's L half,
        WG1 on its block's R half. Eight threads copy a row's 128 bytes (16 B each), a thread 4 rows: 4 row
        offsets a thread. EARLY_ROWS: each round's slots are read a round ahead (their load is off the path
        from a FREE wait to its copies) and once a block, not once a half. L2_AHEAD: the rows of the round that
        far ahead are prefetched into L2 at the start of each round."""
        lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        if a.EARLY_ROWS:
            s0 = _slots(a, a.k0, lay)
            s1 = _slots(a, a.k0 + BK, lay)
        if a.L2_AHEAD > 0:
            for d in gl.static_range(1, a.L2_AHEAD):  # the first rounds past round 0
                _prefetch_l2(a, a.k0 + 2 * d * BK, 1152)
        for r in range(a.n_rounds):
            ph = (r & 1) ^ 1  # a fresh mbarrier passes a wait on phase 1
            start = a.k0 + 2 * r * BK
            b0, b1 = _buffers(a, r)  # WG0's buffer this round, WG1's
            if a.L2_AHEAD > 0:
                _prefetch_l2(a, start + 2 * a.L2_AHEAD * BK, 1152)
            if a.EARLY_ROWS:
                n0 = _slots(a, start + 2 * BK, lay)  # the next round's, in flight through this round's waits
                n1 = _slots(a, start + 3 * BK, lay)
                _fill_early(a, b0, 0, s0, 0, ph, lay)
                _fill_early(a, b1, 1, s1, 1, ph, lay)
                _fill_early(a, b0, 0, s0, 1, ph, lay)
                _fill_early(a, b1, 1, s1, 0, ph, lay)
                s0 = n0
                s1 = n1
            else:
                _fill(a, b0, 0, start, 0, ph, lay)
                _fill(a, b1, 1, start + BK, 1, ph, lay)
                _fill(a, b0, 0, start, 1, ph, lay)
                _fill(a, b1, 1, start + BK, 0, ph, lay)

    @gluon.jit
    def _setup(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, qk_scale, stride_qnt, stride_qnh,
               stride_qrt, stride_qrh, stride_c, r_off, stride_st, stride_os, stride_ot, stride_oh, stride_ls,
               stride_lt, SPLIT: gl.constexpr, P1_MODE: gl.constexpr, FIXED_ROLES: gl.constexpr,
               EARLY_ROWS: gl.constexpr, L2_AHEAD: gl.constexpr, PIN: gl.constexpr, FP8: gl.constexpr):
        """A program's shared memory, barriers, Q and key range: (the `_Args` every partition reads, and for FP8
        (`gluon_sparse_mla_ws_fp8`, `gluon_sparse_mla_dec_fp8`) the key blocks' int8 view and the scale ring, which
        the decode schedule leaves unused). FP8: the key blocks are an int8
        [8, 16 KB] allocation seen as the bf16 blocks, a 2 x 2 x 64 scale ring follows P1's buffer, and the ready
        barriers take the producer's one arrival, not each of its threads' cp.async arrival."""
        t = gl.program_id(0).to(gl.int64)
        hb = gl.program_id(1).to(gl.int64)
        sp = gl.program_id(2).to(gl.int64)
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        q_s = gl.allocate_shared_memory(gl.bfloat16, [64, 512], sw)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], sw)
        if FP8:
            kb = gl.allocate_shared_memory(gl.int8, [8, 16384], flat)  # [block, half, group] groups of 16 KB
            k_s = kb._reinterpret(gl.bfloat16, [2, 64, 512], sw)
        else:
            k_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], sw)
            kb = k_s
        r_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], sw)
        p1_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], sw)
        if FP8:
            sc_s = gl.allocate_shared_memory(gl.float32, [4, 64], flat)  # [ring slot, group] of 64 scales
        else:
            sc_s = p1_s
        m_s = gl.allocate_shared_memory(gl.float32, [64], flat)
        l_s = gl.allocate_shared_memory(gl.float32, [128], flat)  # the two warpgroups' row sums
        bias_s = gl.allocate_shared_memory(gl.float32, [128], flat)  # 0 / -inf a slot of the two blocks
        bars = gl.allocate_shared_memory(gl.int64, [N_BARS, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(FREE):  # ready: the producer's arrival (FP8), or each of its threads' cp.async
            mbarrier.init(bars.index(i), count=1 if FP8 else 128)
        for i in gl.static_range(FREE, N_BARS):
            mbarrier.init(bars.index(i), count=1)
        _load_q(q_s, qn_ptr, t, hb, n_heads, stride_qnt, stride_qnh, 512, 4)
        _load_q(qr_s, qr_ptr, t, hb, n_heads, stride_qrt, stride_qrh, 64, 4)
        slot_base = t * stride_st
        k0, k1, n_tiles = _key_range(slot_ptr, slot_base, sp, n_keys, SPLIT, BK, 4)
        fence_async_shared()
        gl.thread_barrier()
        a = _Args(q_s, qr_s, k_s, r_s, p1_s, m_s, l_s, bias_s, bars, c_ptr, slot_ptr + slot_base,
                  o_ptr + sp * stride_os + t * stride_ot, lse_ptr + sp * stride_ls + t * stride_lt, k0, k1,
                  (n_tiles + 1) // 2, qk_scale, stride_c, r_off, hb * 64, n_heads, stride_oh, SPLIT, P1_MODE,
                  FIXED_ROLES, EARLY_ROWS, L2_AHEAD, PIN)
        return a, kb, sc_s

    @gluon.jit
    def _sparse_mla_ws_kernel(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, qk_scale,
                              stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_c, r_off, stride_st,
                              stride_os, stride_ot, stride_oh, stride_ls, stride_lt, SPLIT: gl.constexpr,
                              P1_MODE: gl.constexpr = 0, FIXED_ROLES: gl.constexpr = False,
                              EARLY_ROWS: gl.constexpr = False, L2_AHEAD: gl.constexpr = 0,
                              PIN: gl.constexpr = False):
        """One token, 64 heads, one split of its top-k (grid: tokens, head blocks, splits); launched with 4 warps
        (the producer) and WS_MAXNREG, the two worker warpgroups added by warp_specialize; the switches after SPLIT
        are VARIANTS'."""
        a, _, _ = _setup(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, qk_scale, stride_qnt,
                         stride_qnh, stride_qrt, stride_qrh, stride_c, r_off, stride_st, stride_os, stride_ot,
                         stride_oh, stride_ls, stride_lt, SPLIT, P1_MODE, FIXED_ROLES, EARLY_ROWS, L2_AHEAD, PIN,
                         False)
        gl.warp_specialize([(_producer, (a,)), (_wg0, (a,)), (_wg1, (a,))], [4, 4], [216, 216])
