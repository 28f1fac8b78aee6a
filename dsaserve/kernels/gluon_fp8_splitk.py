"""Hopper FP8 block-scaled GEMM of up to 128 rows, split over K, warp-specialised (issue 17: batch 33-64 decode's
projections, where cuBLAS leaves most SMs idle; dispatched by `triton_fp8_gemm.splitk_linear`).

Owns: `_fp8_splitk_kernel`, `fp8_splitk_gemm`, `choose_split`, `split_fits`, `tma_ok`, `counters`, `STAGES`, `PDL`.
Why: at decode batch sizes cuBLAS's block-scaled GEMM runs one 128 x 128 output tile a CTA over the whole K (64
rows take as long as 128), so qkv_a (22 tiles), o_proj and the dense down (48) leave most of the 132 SMs idle
(bench/RESULTS.md twenty-eighth session). Splitting K puts 2-6x more SMs on the same tiles. Two earlier split-K
kernels lost to cuBLAS (fourteenth session: Triton, `acc += dot * scale`; thirty-first: a single-partition Gluon
kernel, 131 against 49 us at split 1): each read a K block's token scales from global memory right after the
block's MMA, a dependent round trip every block, and every warp stopped at a CTA barrier twice a block.
The schedule here (DeepGEMM's sm90 FP8 GEMM): a program owns 128 weight rows (one 128 x 128 scale block: the
weight's scale is one scalar a K block) x a tile of 64 or 128 tokens, over its split's K blocks.
  The producer (the default partition, 4 warps) has TMA copy each K block's weight tile and token tile into a ring
  of STAGES buffers (one thread's expect-arrival and the tiles' bytes on the buffer's ready mbarrier; rows past N
  or M arrive as zeros) and cp.async the tokens' scales (each producer thread's arrival when its copy lands).
  Two consumer warpgroups (workers) each take 64 tokens as the wgmma's M (at 128 tokens its half of them x the
  tile's 128 rows, at 64 all of them x its 64 rows): wait for a buffer, one wgmma (m64 x rows x 128), read its
  tokens' scales from shared memory, free the buffer (one arrival each), promote (acc += part x weight scale x
  token scale, fp32: the reference's per-128-K rule). No CTA-wide barrier in the loop (each warpgroup's own before
  it frees a slot). The next block's weight scale is loaded a block ahead (one register).
  Tokens as M, not swap-AB's N (forty-second session): a thread's accumulator rows are then 2 tokens, so a K block's
  promotion reads 2 token scales where swap-AB's 32 columns (128 tokens) took 16 shared loads and 32 multiplies;
  Nsight Compute's samples put a 128-token block's time there, not in the MMA (swap-AB's consumers never waited
  for their wgmma).
Split K: each warpgroup parks its fp32 partial [64 tokens, rows] and the last of a (tile, half)'s splits to arrive
(one counter each, `counters`, reset by it) adds the parts in split order and writes C: CUTLASS's serial split-K,
as `triton_fp8_gemm._split_k_store`, so the result is the same whichever program ends last.
Measured on the H200 (bench/RESULTS.md, fortieth session), against `_scaled_mm` on the same FP8 operands: at 64
rows 1.16-1.29x where K is long (o_proj, the dense down, the shared gate+up, q_a|kv_a|wk); at 128 rows 0.53-0.92x (a
program's tile then runs at ~60 % of cuBLAS's rate per SM: the extra SMs are spent), so it is not dispatched there.
That was swap-AB; with the tokens as M (H100, forty-second session) a 128-token tile at split 1 runs 1.34-1.41x
faster (qkv_a 31.2 -> 22.5 us, o_proj 80.4 -> 58.3, cuBLAS 20.2 / 49.8; 64 tokens 1.10-1.17x), but on that H100 the
splits that fill the GPU read no faster than cuBLAS (o_proj 1.85-1.88 TB/s at split 2 against 1.95-2.02), so 128
rows still lose (0.72-0.95x; the b128 step +133-138 us dispatched there) and the dispatched 64-row splits are
unchanged (within 3 %); not read on an H200, where cuBLAS's 128-row GEMMs are no faster and the bandwidth is 1.4x.
TMA tiles beat cp.async ones by 3-17 % at 128 rows and tied at 64 (the cp.async producer was measured and removed).
Under PDL (`PDL`) the first ring's weight tiles are asked for before the wait for the kernel before. Tried and
not kept (forty-first session, bench/attempts): consumers with the next block's wgmma in flight while one is promoted,
and each tile's K blocks in a rotated order (again with tokens as M, forty-second: from 2 % faster to 5 % slower),
and (forty-second) 6 and 8 ring stages (8 not at 128 tokens): none is what limits it at 128 rows.
No interpreter runs Gluon: CPU runs never reach this kernel; its device test compares it with the reference.
"""

# (no `from __future__ import annotations`: Gluon reads the constexpr annotations)
import functools

import torch
import triton

from dsaserve.kernels.gluon_common import HAVE_GLUON, available  # noqa: F401 - `available` for the dispatcher
from dsaserve.kernels.triton_utils import made_once, pdl_args

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

STAGES = 5  # ring depth: a stage is 16 KB of weights + up to 16 KB of tokens + 512 B of scales
MAX_TILES = 1024  # 128-row output tiles a launch may have (q_b at GLM-5.3 scale: 128; the dense gate_up 192)
# the launch's register cap (4 + 8 warps at 168 fill the register file, 65,536) and the consumers' share by
# setmaxnreg (216; the producer keeps the rest, ~72), as the sparse MLA kernel splits it: a consumer holds a 64 x 128
# fp32 accumulator and a 64 x 128 part (128 registers)
PRODUCER_WARPS, MAXNREG, CONSUMER_REGS = 4, 168, 216
# launched under PDL where the GPU has it (`triton_utils.pdl_args`): the first ring's weight tiles load during the
# kernel before. H100, the b64 1K step, one process, 3 rounds each: -12 to -14 us overlapped in two calls (bench/
# RESULTS.md, forty-first session); False for A/Bs (profile_decode --ab splitk:pdl=0)
PDL = True
_COUNTERS: dict = {}


def counters(device: torch.device) -> torch.Tensor:
    """Arrival counters, zero between launches: [2 (compute stream, side stream), MAX_TILES, 2 halves]. A GEMM on
    a side stream (the shared expert's, beside the routed ones) must not share the compute stream's."""
    return made_once(_COUNTERS, device.index, device, "fp8_splitk_counters",
                     lambda: torch.zeros(2, MAX_TILES, 2, dtype=torch.int32, device=device))


if HAVE_GLUON:

    @gluon.jit
    def _weights(w_desc, w_s, ready, s, n0, kb, BLOCK_T: gl.constexpr):
        """Ring slot s's ready barrier told the stage's bytes, and K block kb's weight rows [n0, n0 + 128) (TMA)."""
        mbarrier.expect(ready.index(s), (128 + BLOCK_T) * 128)
        tma.async_copy_global_to_shared(w_desc, [n0.to(gl.int32), kb * 128], ready.index(s), w_s.index(s))

    @gluon.jit
    def _tokens(x_desc, xs_ptr, x_s, xs_s, ready, s, kb, M, stride_xsm, stride_xsk):
        """K block kb's token tile (TMA) and the tokens' scales (cp.async, 4 B a producer thread) into ring slot s;
        each thread's arrival on the slot's ready barrier when its copy lands."""
        tma.async_copy_global_to_shared(x_desc, [0, kb * 128], ready.index(s), x_s.index(s))
        toks = gl.arange(0, 128, layout=gl.BlockedLayout([1], [32], [4], [0]))
        async_copy.async_copy_global_to_shared(xs_s.index(s), (xs_ptr + kb * stride_xsk) + toks * stride_xsm,
                                               mask=toks < M)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)

    @gluon.jit
    def _producer(w_desc, x_desc, xs_ptr, w_s, x_s, xs_s, ready, free, n0, kb0, n_iter, M, stride_xsm, stride_xsk,
                  BLOCK_T: gl.constexpr, STAGES: gl.constexpr, PDL: gl.constexpr):
        """Each K block's weight rows [n0, n0 + 128) and the tokens' e4m3 values (TMA) and their scales (cp.async)
        into ring slot it % STAGES once both consumers freed it. The first ring's weight tiles are asked for first:
        under PDL before the wait for the kernel before (weights are no kernel's output), so they stream in during
        its tail; only the tokens wait for it. (The consumers need no wait: they read only the ring, the weights'
        scales and, at the end, the outputs and counters, after tiles that came after the wait.)"""
        first = gl.minimum(n_iter, STAGES)
        for it in range(first):
            _weights(w_desc, w_s, ready, it, n0, kb0 + it, BLOCK_T)
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)
        for it in range(first):
            _tokens(x_desc, xs_ptr, x_s, xs_s, ready, it, kb0 + it, M, stride_xsm, stride_xsk)
        for it in range(first, n_iter):
            s = it % STAGES
            mbarrier.wait(free.index(s), ((it // STAGES) & 1) ^ 1)
            _weights(w_desc, w_s, ready, s, n0, kb0 + it, BLOCK_T)
            _tokens(x_desc, xs_ptr, x_s, xs_s, ready, s, kb0 + it, M, stride_xsm, stride_xsk)

    @gluon.jit
    def _write(acc, tok, row, mask, part_ptr, c_ptr, cnt, sp, stride_ps, stride_pm, stride_cm):
        """acc (tokens tok x weight rows row: broadcast 2-D offsets) into C where K is not split, else parked as
        split sp's part; the last of the (tile, half)'s splits to arrive (counter cnt) adds the parts in split
        order, writes C and zeroes the counter (graph replays need no memset)."""
        if gl.num_programs(1) == 1:
            gl.store(c_ptr + tok * stride_cm + row, acc.to(c_ptr.dtype.element_ty), mask=mask)
        else:
            offs = tok * stride_pm + row
            gl.store(part_ptr + sp * stride_ps + offs, acc, mask=mask)
            gl.thread_barrier()  # every thread's part is written before the signal (release is cumulative)
            arrived = gl.atomic_add(cnt, 1, sem="acq_rel")
            if arrived == gl.num_programs(1) - 1:
                total = gl.zeros_like(acc)
                for p in range(gl.num_programs(1)):
                    total += gl.load(part_ptr + p * stride_ps + offs, mask=mask, other=0.0, cache_modifier=".cg")
                gl.store(c_ptr + tok * stride_cm + row, total.to(c_ptr.dtype.element_ty), mask=mask)
                gl.atomic_xchg(cnt, 0)

    @gluon.jit
    def _consumer(w_s, x_s, xs_s, ready, free, ws_ptr, part_ptr, c_ptr, cnt_ptr, nb, n0, sp, kb0, n_iter, M, N,
                  stride_wsn, stride_wsk, stride_ps, stride_pm, stride_cm, WG: gl.constexpr,
                  BLOCK_T: gl.constexpr, STAGES: gl.constexpr):
        """64 tokens x BLOCK_T weight rows over the split's K blocks, then C or the split's part: at 128 tokens
        warpgroup WG's half of the tokens x the tile's 128 rows, at 64 every token x its 64 rows. The tokens are the
        wgmma's M, so a thread's accumulator rows are 2 tokens and a K block's promotion reads 2 token scales."""
        gl.static_assert(BLOCK_T == 64 or BLOCK_T == 128, "a token tile is 64 or 128 rows (`block_tokens`)")
        T0: gl.constexpr = WG * (BLOCK_T - 64)  # the warpgroup's first token
        R0: gl.constexpr = WG * (128 - BLOCK_T)  # and first weight row in the tile
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_T, 32])
        acc = gl.zeros([64, BLOCK_T], gl.float32, layout=acc_l)
        part = gl.zeros([64, BLOCK_T], gl.float32, layout=acc_l)
        ws_row = ws_ptr + nb * stride_wsn
        w_scale = gl.load(ws_row + kb0 * stride_wsk)
        for it in range(n_iter):
            s = it % STAGES
            mbarrier.wait(ready.index(s), (it // STAGES) & 1)
            fence_async_shared()  # order this thread's view of the slot (TMA tiles, cp.async scales) before the wgmma
            part = warpgroup_mma(x_s.index(s).slice(T0, 64, dim=0),
                                 w_s.index(s).slice(R0, BLOCK_T, dim=0).permute((1, 0)), part, use_acc=False,
                                 is_async=True)
            nxt = gl.minimum(it + 1, n_iter - 1)  # the next block's weight scale, in flight under this MMA
            w_next = gl.load(ws_row + (kb0 + nxt) * stride_wsk)
            # (tokens past M: a zero row's part times a scale the masked cp.async did not write; never stored)
            x_scale = xs_s.index(s).slice(T0, 64).load(gl.SliceLayout(1, acc_l))
            part = warpgroup_mma_wait(num_outstanding=0, deps=[part])
            gl.thread_barrier()  # this partition's warps: every thread's reads of the slot are done
            mbarrier.arrive(free.index(s), count=1)
            acc += part * (x_scale * w_scale)[:, None]
            w_scale = w_next
        toks = T0 + gl.arange(0, 64, layout=gl.SliceLayout(1, acc_l)).to(gl.int64)
        rows = n0 + R0 + gl.arange(0, BLOCK_T, layout=gl.SliceLayout(0, acc_l)).to(gl.int64)
        mask = (toks < M)[:, None] & (rows < N)[None, :]
        _write(acc, toks[:, None], rows[None, :], mask, part_ptr, c_ptr, cnt_ptr + nb * 2 + WG, sp, stride_ps,
               stride_pm, stride_cm)

    @gluon.jit
    def _fp8_splitk_kernel(x_desc, xs_ptr, w_desc, ws_ptr, part_ptr, c_ptr, cnt_ptr, M, N, kblocks, kb_per_split,
                           stride_xsm, stride_xsk, stride_wsn, stride_wsk, stride_ps, stride_pm, stride_cm,
                           BLOCK_T: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                           PDL: gl.constexpr = False):
        """Grid (128-row tiles, splits); x and the weight as TMA descriptors; launched with PRODUCER_WARPS warps and
        MAXNREG, the two consumer warpgroups added by warp_specialize."""
        nb = gl.program_id(0)
        sp = gl.program_id(1)
        n0 = nb.to(gl.int64) * 128
        kb0 = sp * kb_per_split
        n_iter = gl.minimum(kb_per_split, kblocks - kb0)  # the last split may be shorter (never empty: the host)
        sw: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        w_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, 128, 128], sw)
        x_s = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_T, 128], sw)
        xs_s = gl.allocate_shared_memory(gl.float32, [STAGES, 128], flat)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=129)  # the TMA expect's arrival + each producer thread's cp.async
            mbarrier.init(free.index(i), count=2)  # one arrival a consumer warpgroup
        fence_async_shared()
        gl.thread_barrier()
        gl.warp_specialize([(_producer, (w_desc, x_desc, xs_ptr, w_s, x_s, xs_s, ready, free, n0, kb0, n_iter, M,
                                         stride_xsm, stride_xsk, BLOCK_T, STAGES, PDL)),
                            (_consumer, (w_s, x_s, xs_s, ready, free, ws_ptr, part_ptr, c_ptr, cnt_ptr, nb, n0, sp, kb0,
                                         n_iter, M, N, stride_wsn, stride_wsk, stride_ps, stride_pm, stride_cm, 0,
                                         BLOCK_T, STAGES)),
                            (_consumer, (w_s, x_s, xs_s, ready, free, ws_ptr, part_ptr, c_ptr, cnt_ptr, nb, n0, sp, kb0,
                                         n_iter, M, N, stride_wsn, stride_wsk, stride_ps, stride_pm, stride_cm, 1,
                                         BLOCK_T, STAGES))],
                           [4, 4], [CONSUMER_REGS, CONSUMER_REGS])


def block_tokens(m: int) -> int:
    """The token tile for m tokens: 64 (each warpgroup's wgmma M; rows past m arrive as zeros) or 128."""
    return 64 if m <= 64 else 128


def split_fits(kblocks: int, split: int) -> bool:
    """Whether `kblocks` K blocks cut into parts of ceil(kblocks / split) make exactly `split` parts (none empty)."""
    return split >= 1 and triton.cdiv(kblocks, triton.cdiv(kblocks, split)) == split


@functools.lru_cache(maxsize=256)  # asked at every dispatch (`triton_fp8_gemm.splitk_linear`): a pure function
def choose_split(n: int, k: int, sms: int, min_blocks: int = 4) -> int:
    """Splits of K's 128-blocks for an [N, K] weight: counting up from 2 while every program stays in one wave of
    `sms` (one program an SM: its shared memory) and the last split is not empty, the last such count (parts of
    ceil(blocks / split), at least `min_blocks` blocks each but the last); 1 where none fits."""
    tiles, kblocks = triton.cdiv(n, 128), k // 128
    best = 1
    for split in range(2, kblocks // min_blocks + 1):
        if tiles * split > sms or not split_fits(kblocks, split):  # past one wave, or an empty last split
            break
        best = split
    return best


def fp8_splitk_gemm(x_fp8: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                    split: int, out_dtype: torch.dtype = torch.bfloat16, stages: int | None = None,
                    side_stream: bool = False) -> torch.Tensor:
    """y [M, N] = x @ dequant(weight)^T from x quantised per (token, 128) (`quant_act_fp8`: e4m3 [M, K], fp32 scales
    [M, K/128], any strides) and the 128 x 128 block-scaled weight [N, K]; M <= 128, K a multiple of 128 cut into
    `split` parts of whole blocks (the last may be shorter, none empty); x and the weight row-major with 16-byte
    aligned rows (TMA: `tma_ok`). `side_stream`: the counters of GEMMs that may run beside the compute stream's;
    stages: the ring's depth (default STAGES; bench sweeps)."""
    m, k = x_fp8.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"fp8_splitk_gemm: x has K={k}, the weight is {tuple(weight.shape)}")
    kblocks = k // 128
    if not 1 <= m <= 128 or k % 128 or not split_fits(kblocks, split):
        raise ValueError(f"fp8_splitk_gemm: M {m} (1..128), K {k} (128 blocks) and split {split} do not fit")
    if not (tma_ok(x_fp8) and tma_ok(weight)):
        raise ValueError("fp8_splitk_gemm: x and the weight must be row-major with 16-byte aligned rows (TMA)")
    tiles = triton.cdiv(n, 128)
    if tiles > MAX_TILES:
        raise ValueError(f"fp8_splitk_gemm: {tiles} output tiles, more than MAX_TILES {MAX_TILES}")
    c = torch.empty(m, n, dtype=out_dtype, device=x_fp8.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x_fp8.device) if split > 1 else c
    bt = block_tokens(m)
    sw = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    _fp8_splitk_kernel[(tiles, split)](
        TensorDescriptor.from_tensor(x_fp8, [bt, 128], sw), x_scale,
        TensorDescriptor.from_tensor(weight, [128, 128], sw), weight_scale, part, c,
        counters(x_fp8.device)[int(side_stream)], m, n, kblocks, triton.cdiv(kblocks, split), x_scale.stride(0),
        x_scale.stride(1), weight_scale.stride(0), weight_scale.stride(1), part.stride(0), part.stride(-2),
        c.stride(0), BLOCK_T=bt, STAGES=STAGES if stages is None else stages, CONSUMER_REGS=CONSUMER_REGS,
        num_warps=PRODUCER_WARPS, maxnreg=MAXNREG, **(pdl_args(x_fp8.device) if PDL else {}))
    return c


def tma_ok(t: torch.Tensor) -> bool:
    """Whether TMA can read this 2-D e4m3 tensor's tiles: contiguous rows, base and row stride 16-byte aligned."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
