"""GPU FP8 block-scaled GEMM: `fp8_linear` (request path stage 6: every quantised projection).

Owns: the GPU variant of `reference.fp8_linear` and the per-(token, 128-group) activation quantiser the
MoE kernels share. Two paths, chosen per call by M (a static shape, so a CUDA graph always replays the
path it captured):
- M <= SMALL_M (decode): a Triton skinny GEMM that streams the FP8 weight once (swap-AB: the weight
  rows are the MMA's M, the few tokens its N). Activations are quantised per (token, 128-group) to e4m3
  (one small kernel) and the FP8 tiles go to the tensor cores as they are; both block scales multiply
  each K-block's partial sum. Variants kept for tests and sweeps: bf16 activations (FP8 weight tiles
  widened in registers: exact, but ~1.4x slower) and an FMA GEMV for one token.
- M > SMALL_M (prefill): activations quantised per (token, 128-group) to e4m3 by a Triton kernel, then
  `torch._scaled_mm` with DeepSeek block scaling (1x128 activation scales, outer-dim-major; 128x128
  weight scales = weight_scale_inv^T). cuBLAS rejects M not a multiple of 16 (M = 1, 2, 15 fail on the
  H200, DESIGN.md "Kernels"), so M is padded. Shapes cuBLAS's block scaling does not take (N or K not a
  multiple of 128) use the Triton kernel with FP8 activations instead.
Imported only by `kernels/registry.py` after it checked that Triton and a CUDA device are there.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dsaserve.kernels import cublaslt_tuning, gluon_fp8_splitk
from dsaserve.kernels.triton_utils import TensorNote, grid_dependency_sync, made_once, on_side_stream, pdl_args

FP8_BLOCK = 128  # DeepSeek/GLM weight_scale_inv block, and the activation quant group
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_MAX_C = tl.constexpr(FP8_MAX)  # a plain float global is not visible inside @triton.jit
# H200, 2026-11-29 (bench/RESULTS.md): the FP8-activation skinny kernel beats quant + _scaled_mm on every
# GLM-5.3 projection up to M = 32 (16384x6144, M=1: 33 us = 3.05 TB/s vs 40.9 us; bf16 cuBLAS 50.9 us);
# at M = 64 _scaled_mm is ahead (38.0 vs 42.0 us)
SMALL_M = 32  # M up to this: the skinny Triton kernel; above, _scaled_mm
SKINNY_MAX_M = 64  # shapes _scaled_mm cannot take use the skinny kernel up to this M, the FP8-act Triton GEMM above


@functools.lru_cache(maxsize=8)
def num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 132  # H200; only reached under TRITON_INTERPRET on the CPU
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.is_cuda else None)


# ---- activation quantisation: [M, K] -> e4m3 [M_pad, K] + fp32 scales [M_pad, K/128] -------------------
@triton.jit
def quant_rows_fp8(x):
    """x [R, G] fp32 -> (e4m3 [R, G], fp32 scale [R]): kv_layout._quant_fp8's rule, scale = max(amax, 1e-12) /
    448, values clamped to +-448 (a zero row quantises to zeros). Every activation quantiser uses it."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / FP8_MAX_C
    return tl.clamp(x / scale[:, None], -FP8_MAX_C, FP8_MAX_C).to(tl.float8e4nv), scale


@triton.jit
def _quant_group_kernel(x_ptr, q_ptr, s_ptr, M, M_PAD, K, stride_xm, stride_qm, stride_sm, stride_sk,
                        GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, ROWS_PER_PROG: tl.constexpr,
                        PDL: tl.constexpr = False):
    """ROWS_PER_PROG rows x GROUPS_PER_PROG groups a program, one (row, group) a row of the quantiser's tile:
    one row a program made an 8K-token prefill's quantisation 4x its bytes' time (tiny programs)."""
    grid_dependency_sync(PDL)
    rg = tl.arange(0, ROWS_PER_PROG * GROUPS_PER_PROG)
    m = tl.program_id(0).to(tl.int64) * ROWS_PER_PROG + rg // GROUPS_PER_PROG  # int64: [T*k, I] passes 2^31
    offs_g = tl.program_id(1) * GROUPS_PER_PROG + rg % GROUPS_PER_PROG
    offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    kmask = (offs_k < K) & (m < M_PAD)[:, None]
    x = tl.load(x_ptr + m[:, None] * stride_xm + offs_k, mask=kmask & (m < M)[:, None], other=0.0).to(tl.float32)
    q, scale = quant_rows_fp8(x)  # padding rows quantise to zeros
    tl.store(q_ptr + m[:, None] * stride_qm + offs_k, q, mask=kmask)
    tl.store(s_ptr + m * stride_sm + offs_g * stride_sk, scale, mask=(offs_g * GROUP < K) & (m < M_PAD))


# overrides of `quant_tile` for every call (bench/profile_decode.py's "quant:" A/B settings): "rows", "groups"
QUANT_TILE: dict = {}


def quant_tile(mp: int, kg: int) -> tuple[int, int]:
    """(rows, 128-groups) a program of `_quant_group_kernel` for mp rows of kg groups: 16 groups, one row below 512
    rows, two from there. H200 (bench/probe_scaled_mm_rows.py --quant, bench/RESULTS.md twenty-eighth session), the
    tile before (one row of 4 groups; 4 rows of 4 from 512) against this one: 128 x 16384 (o_proj's input) 6.01
    against 3.02 us, 128 x 12288 4.85 / 2.71, 128 x 6144 2.88 / 2.26, 1024 x 2048 2.91 / 2.68; in the slice's
    batch-128 step 3.144-3.149 ms overlapped against 3.162-3.173."""
    rpp = 2 if mp >= 512 else 1
    rows, groups = QUANT_TILE.get("rows", rpp), min(QUANT_TILE.get("groups", 16), triton.next_power_of_2(kg))
    if rows & (rows - 1) or groups & (groups - 1) or min(rows, groups) < 1:  # the kernel's tl.arange of their product
        raise ValueError(f"QUANT_TILE: rows {rows} and groups {groups} must be powers of two")
    return rows, groups


def quant_act_fp8(x: torch.Tensor, pad_m_to: int = 1, scale_m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M_pad, K], fp32 scales [M_pad, ceil(K/128)]), M_pad = M rounded up to pad_m_to.

    scale_m_major=True lays the scales out outer-dim-major (stride (1, M_pad)), as `_scaled_mm` wants.
    """
    m, k = x.shape
    mp = -(-m // pad_m_to) * pad_m_to
    kg = -(-k // FP8_BLOCK)
    q = torch.empty(mp, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(kg, mp, dtype=torch.float32, device=x.device).t() if scale_m_major else \
        torch.empty(mp, kg, dtype=torch.float32, device=x.device)
    rpp, gpp = quant_tile(mp, kg)
    if mp > 0:
        _quant_group_kernel[(triton.cdiv(mp, rpp), triton.cdiv(kg, gpp))](
            x, q, s, m, mp, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), GROUP=FP8_BLOCK,
            GROUPS_PER_PROG=gpp, ROWS_PER_PROG=rpp, **pdl_args(x.device))
    return q, s


# ---- activations quantised by the kernel that produced them ------------------------------------------
# A decode step's GEMM inputs mostly come out of a row kernel (RMSNorm, SiLU*up) that has the row in
# registers anyway: it writes the e4m3 copy + scales beside the bf16 output (`triton_elementwise`) and
# hangs them on the output tensor, so the GEMM skips its own quantiser launch (~30 launches per step).
# Invariant: only a freshly produced tensor that nobody modifies in place carries the attachment.
_FP8_COPY = TensorNote("_dsaserve_fp8_act")
# ... and, at 33+ rows, the same values' scales outer-dim-major, as cuBLAS's block-scaled GEMM reads them
_FP8_SCALES_M = TensorNote("_dsaserve_fp8_scales_m")
# rows (33 up to this, a multiple of 16: cuBLAS's M) whose row-kernel outputs carry their FP8 copy with both scale
# layouts, so neither the cuBLAS projections nor the MoE quantise them again (27 of a batch-128 step's ~39
# quantiser launches, ~2-3 us each on the step's chain; thirty-seventh session). A/B (bench/RESULTS.md), H200 b64
# 1K -8 us, b128 in the spread; H100 b128 1K -8 to -17 us, b64 -5 to -10, every round. 0: no copy past SMALL_M
# rows (profile_decode's "no_copy_for_cublas"; bench/attempts/fp8_copy_for_scaled_mm.patch: the one-layout try).
CUBLAS_COPY_MAX_ROWS = 512
CUBLAS_M = 16  # cuBLAS's block-scaled GEMM takes M in multiples of 16 (`scaled_mm_linear` pads to it)


def attach_fp8(y: torch.Tensor, q: torch.Tensor, s: torch.Tensor,
               s_m: torch.Tensor | None = None) -> torch.Tensor:
    """Remember that (q, s) = `quant_act_fp8(y)` (same rule, same layout); s_m: the same scales outer-dim-major
    ([K/128, M] transposed, as `quant_act_fp8(y, scale_m_major=True)` lays them out)."""
    if s_m is not None:
        _FP8_SCALES_M.attach(y, (q, s_m))
    return _FP8_COPY.attach(y, (q, s))


def cached_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    return _FP8_COPY.get(x)


def cached_fp8_m_major(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """x's FP8 copy with outer-dim-major scales (`attach_fp8(s_m=)`), for cuBLAS; None where none was made."""
    return _FP8_SCALES_M.get(x)


def copy_buffers(rows: int, n: int, dtype: torch.dtype,
                 device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(e4m3 [rows, n], row-major scales [rows, n/128], outer-dim-major scales or None) for the FP8 copy a row
    kernel writes beside its output [rows, n], or None where it writes none: up to SMALL_M rows the row-major
    scales (the skinny GEMM's); from there up to CUBLAS_COPY_MAX_ROWS rows that are a multiple of CUBLAS_M both
    layouts, one buffer (the kernels find the second past the first: [rows * n/128] then [n/128, rows])."""
    big = SMALL_M < rows <= CUBLAS_COPY_MAX_ROWS and rows % CUBLAS_M == 0
    if (rows > SMALL_M and not big) or n % FP8_BLOCK or dtype not in (torch.bfloat16, torch.float16):
        return None
    kg = n // FP8_BLOCK
    q = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty((2 if big else 1) * rows * kg, dtype=torch.float32, device=device)
    s_m = scales[rows * kg:].view(kg, rows).t() if big else None
    return q, scales[: rows * kg].view(rows, kg), s_m


# ---- the Triton block-scaled GEMM (skinny decode path; FP8-activation fallback for odd shapes) ---------
@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, kb_per_split, n_kb,
                     stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cs, stride_cm,
                     A_FP8: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1).to(tl.int64)  # M x N of a prefill output passes 2^31 (issue 17)
    pid_s = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of W [N, K]
    bs_ptrs = bs_ptr + (offs_n // 128) * stride_bsn
    kb0 = pid_s * kb_per_split  # even K parts (`even_split`)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in range(0, kb_per_split):
        kb = kb0 + i
        if EVEN_K:
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=mmask[:, None], other=0.0)
            b = tl.load(b_ptrs + kb * BLOCK_K, mask=nmask[None, :], other=0.0)
        else:
            kmask = kb * BLOCK_K + offs_k < K
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=mmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(b_ptrs + kb * BLOCK_K, mask=kmask[:, None] & nmask[None, :], other=0.0)
        bs = tl.load(bs_ptrs + kb * stride_bsk, mask=nmask, other=0.0)
        if A_FP8:
            a_s = tl.load(as_ptr + offs_m * stride_asm + kb * stride_ask, mask=mmask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * bs[None, :]
        elif a_ptr.dtype.element_ty == tl.float32:  # the float32 path: float32 products, no bf16 rounding of x
            acc += tl.dot(a, b.to(tl.float32), input_precision="ieee") * bs[None, :]
        else:
            acc += tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16)) * bs[None, :]
    c_ptrs = c_ptr + pid_s * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _part(part_ptr, s, n_split, p_off, mask, stride_ps):
    """Split s's parked part (zeros past the splits)."""
    return tl.load(part_ptr + s * stride_ps + p_off, mask=mask & (s < n_split), other=0.0, cache_modifier=".cg")


@triton.jit
def _split_k_store(acc, c_ptr, part_ptr, cnt_ptr, tile, pid_s, n_split, offs_n, offs_m, mask, stride_cm,
                   stride_pm, stride_ps, PARTS_AT_ONCE: tl.constexpr):
    """Store acc^T [BN, BM] to C, or, split K: park it in the fp32 workspace and let the last of the
    tile's n_split programs (one atomic counter per tile) add the others' parts and store C, then reset
    the counter for the next launch (so CUDA-graph replays need no memset). CUTLASS's serial split-K. The last
    program loads four parts before adding them, in split order (PARTS_AT_ONCE; else one at a time: each load
    waited for before the next, a chain of n_split L2 round trips at the end of every split GEMV)."""
    c_ptrs = c_ptr + offs_m[None, :] * stride_cm + offs_n[:, None]
    if n_split == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        p_off = offs_m[None, :] * stride_pm + offs_n[:, None]
        tl.store(part_ptr + pid_s * stride_ps + p_off, acc, mask=mask)
        tl.debug_barrier()  # every thread's part is written before one thread signals (release is cumulative)
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == n_split - 1:  # sum every part from the workspace in split order: deterministic
            total = tl.zeros(acc.shape, dtype=tl.float32)  # whichever program happens to arrive last
            if PARTS_AT_ONCE:  # four parts' loads in flight before the first add waits
                for s0 in range(0, n_split, 4):
                    p0 = _part(part_ptr, s0, n_split, p_off, mask, stride_ps)
                    p1 = _part(part_ptr, s0 + 1, n_split, p_off, mask, stride_ps)
                    p2 = _part(part_ptr, s0 + 2, n_split, p_off, mask, stride_ps)
                    p3 = _part(part_ptr, s0 + 3, n_split, p_off, mask, stride_ps)
                    total += p0
                    total = tl.where(s0 + 1 < n_split, total + p1, total)
                    total = tl.where(s0 + 2 < n_split, total + p2, total)
                    total = tl.where(s0 + 3 < n_split, total + p3, total)
            else:
                for s in range(0, n_split):
                    total += _part(part_ptr, s, n_split, p_off, mask, stride_ps)
            tl.store(c_ptrs, total.to(c_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _fp8_skinny_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, part_ptr, cnt_ptr, M, N, K, kb_per_split, n_kb, n_split,
                       stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm, stride_pm,
                       stride_ps,
                       FMA: tl.constexpr, A_FP8: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTS_AT_ONCE: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    """Decode GEMM with the weight as the row operand: C^T [BN, BM] = W [BN, BK] @ x^T [BK, BM] per K step.

    W tiles are read row-major (K contiguous, 16-byte loads); the tiny token count is the MMA's N
    (swap-AB). A_FP8: x comes quantised per (token, 128) (`quant_act_fp8`) and the FP8 tiles go to the
    tensor cores as they are, both scales applied to each K step's partial sums; otherwise the weight tile
    is widened to bf16 (exact activations). FMA=True (BLOCK_M == 1) skips the tensor cores: an fp32
    multiply-accumulate reduced once at the end. Split K reduces in the kernel (`_split_k_store`).
    Quantising x in registers at each K step instead of by a separate kernel was measured 1.3-1.6x slower
    on the H200 (the quantised tile's trip through shared memory stalls the weight stream).
    """
    grid_dependency_sync(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    nmask = offs_n < N
    mmask = offs_m < M
    w_ptrs = b_ptr + offs_n[:, None] * stride_bn + offs_k[None, :]
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    bs_ptrs = bs_ptr + (offs_n // 128) * stride_bsn
    kb0 = pid_s * kb_per_split  # the splits divide the K blocks evenly (`skinny_gemm`)
    if FMA:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for i in range(0, kb_per_split):
        kb = kb0 + i
        if EVEN_K:
            w = tl.load(w_ptrs + kb * BLOCK_K, mask=nmask[:, None], other=0.0)
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=mmask[:, None], other=0.0)
        else:
            kmask = kb * BLOCK_K + offs_k < K
            w = tl.load(w_ptrs + kb * BLOCK_K, mask=nmask[:, None] & kmask[None, :], other=0.0)
            a = tl.load(a_ptrs + kb * BLOCK_K, mask=mmask[:, None] & kmask[None, :], other=0.0)
        bs = tl.load(bs_ptrs + kb * stride_bsk, mask=nmask, other=0.0)
        if FMA:
            acc2 += w.to(tl.float32) * (a.to(tl.float32) * 1.0) * bs[:, None]
        elif A_FP8:
            a_s = tl.load(as_ptr + offs_m * stride_asm + kb * stride_ask, mask=mmask, other=0.0)
            acc += tl.dot(w, tl.trans(a)) * bs[:, None] * a_s[None, :]
        elif a_ptr.dtype.element_ty == tl.float32:  # the float32 path: float32 products, no bf16 rounding of x
            acc += tl.dot(w.to(tl.float32), tl.trans(a), input_precision="ieee") * bs[:, None]
        else:
            acc += tl.dot(w.to(tl.bfloat16), tl.trans(a.to(tl.bfloat16))) * bs[:, None]
    if FMA:
        acc = tl.sum(acc2, axis=1)[:, None]
    tile = pid_m * tl.num_programs(0) + pid_n
    _split_k_store(acc, c_ptr, part_ptr, cnt_ptr, tile, pid_s, n_split, offs_n, offs_m,
                   nmask[:, None] & mmask[None, :], stride_cm, stride_pm, stride_ps, PARTS_AT_ONCE)


MAX_SPLIT_TILES = 1 << 14
# the split GEMV's last program loads four parts at once before summing them (False: one at a time; bench/
# profile_decode.py's "split_sum_serial")
SPLIT_PARTS_AT_ONCE = True


def even_split(kblocks: int, want: int) -> int:
    """The largest split <= want that divides the K blocks evenly (every program runs the same trip count,
    which also keeps the loop bounds plain integers for the Triton interpreter)."""
    return max(d for d in range(1, max(1, min(want, kblocks)) + 1) if kblocks % d == 0)


_SPLIT_COUNTERS: dict[int | None, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """[2 (compute stream, side stream: `on_side_stream`), MAX_SPLIT_TILES] int32 arrival counters, one a tile, zero
    between launches (the last program resets its own). Made once per device (`triton_utils.made_once`). Each set
    shared by its stream's split GEMMs, which run one after another there."""
    return made_once(_SPLIT_COUNTERS, device.index, device, "split_counters",
                     lambda: torch.zeros(2, MAX_SPLIT_TILES, dtype=torch.int32, device=device))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fma: bool, block_m: int, block_n: int,
                split: int, num_warps: int, num_stages: int, out_dtype: torch.dtype,
                a_fp8: bool = False, act: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode path (`_fp8_skinny_kernel`) with an explicit tile config; fma needs block_m == 1.
    act: x already quantised (`cached_fp8`), used when a_fp8."""
    m, k = x.shape
    n = weight.shape[0]
    kblocks = triton.cdiv(k, FP8_BLOCK)
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    split = even_split(kblocks, split) if tiles <= MAX_SPLIT_TILES else 1
    kb_per_split = kblocks // split
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    a, a_s = (act or quant_act_fp8(x)) if a_fp8 else (x, x)
    c = torch.empty(m, n, dtype=out_dtype, device=x.device)
    part = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else c
    counters = split_counters(x.device)[on_side_stream(x.device) if split > 1 else 0]  # unread unsplit
    _fp8_skinny_kernel[grid](a, a_s, weight, scale, c, part, counters, m, n, k, kb_per_split, kblocks, split,
                             a.stride(0), a_s.stride(0) if a_fp8 else 0, a_s.stride(1) if a_fp8 else 0,
                             weight.stride(0), scale.stride(0), scale.stride(1),
                             c.stride(0), part.stride(-2), part.stride(0) if split > 1 else 0, FMA=fma, A_FP8=a_fp8,
                             EVEN_K=(k % FP8_BLOCK == 0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_BLOCK,
                             PARTS_AT_ONCE=split > 1 and SPLIT_PARTS_AT_ONCE,
                             num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device))
    return c


def skinny_config(m: int, n: int, k: int, sms: int) -> dict:
    """Tile choice for the decode path (BLOCK_K = 128 = the scale block, so one scale per K step).

    FP8 activations (swap-AB on FP8 tensor cores): measured faster than both bf16-activation variants
    (widening FP8 weights to bf16 in registers capped them near 2.2 TB/s) at every decode shape.
    H200 sweep of the GLM-5.3 projections (bench/sweep_skinny.py, bench/RESULTS.md): split K only when the
    N tiles leave SMs idle and K is long (o_proj 35.9 -> 32.4 us at split 4; at K = 2048 splitting lost:
    idx_wq_b 8.5 vs 7.5 us unsplit), to at least 2 waves, rounding the split up to a divisor of the K blocks;
    6 pipeline stages at one M block of 16.
    """
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 128 if m > 32 else 64  # sweep at M = 64: 128-wide tiles 42.0 us, 64-wide 45.4 us
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    kblocks = triton.cdiv(k, FP8_BLOCK)
    split = 1
    if 0 < tiles < sms and kblocks > 16:  # m = 0 (an EP rank's empty token chunk) has no tiles to split
        want = min(triton.cdiv(2 * sms, tiles), kblocks // 2)  # each part keeps >= 2 K blocks
        split = min((d for d in range(want, kblocks // 2 + 1) if kblocks % d == 0), default=even_split(kblocks, want))
    return {"fma": False, "a_fp8": True, "block_m": block_m, "block_n": block_n, "split": split, "num_warps": 4,
            "num_stages": 6 if block_m == 16 else 4}


def triton_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, a_fp8: bool, block_m: int,
                block_n: int, split: int, num_warps: int, num_stages: int, out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(weight)^T with an explicit tile config (bench sweeps call this)."""
    m, k = x.shape
    n = weight.shape[0]
    if a_fp8:
        a, a_s = quant_act_fp8(x)
    else:
        a, a_s = x, x  # a_s unused when A is bf16
    kblocks = triton.cdiv(k, FP8_BLOCK)
    split = even_split(kblocks, split)
    kb_per_split = kblocks // split
    c = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else out_dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _fp8_gemm_kernel[grid](a, a_s, weight, scale, c, m, n, k, kb_per_split, kblocks,
                           a.stride(0), a_s.stride(0) if a_fp8 else 0, a_s.stride(1) if a_fp8 else 0,
                           weight.stride(0), scale.stride(0), scale.stride(1), c.stride(0), c.stride(1),
                           A_FP8=a_fp8, EVEN_K=(k % FP8_BLOCK == 0), BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=FP8_BLOCK, num_warps=num_warps, num_stages=num_stages, **pdl_args(x.device))
    return c[0] if split == 1 else c.sum(0).to(out_dtype)


def scaled_mm_ok(n: int, k: int, device: torch.device) -> bool:
    """cuBLAS block scaling (1x128 x 128x128) on Hopper; other shapes/devices use the Triton kernel.

    cuBLASLt reads the weight's scales as [round_up(K/128, 4), N/128] with leading dimension round_up(K/128, 4)
    (its "scaling factors layout"; pytorch PR 166752). Ours is [K/128, N/128] unpadded, so with K/128 not a
    multiple of 4 cuBLAS reads every 128-column block after the first at the wrong offset, the last ones
    past the tensor: a silently wrong output (found on glm-5.3-tiny, K = 256: the merged q_a|kv_a|wk GEMM's
    indexer-key columns came out zero on one process and garbage on another). GLM-5.3's and
    DeepSeek-V3.2's K are all multiples of 512; the small configs take the Triton GEMM."""
    return device.type == "cuda" and scaled_mm_shape_ok(n, k) and torch.cuda.get_device_capability(device) == (9, 0)


def scaled_mm_shape_ok(n: int, k: int) -> bool:
    """The shapes `scaled_mm_ok` lets cuBLAS's block scaling take, whatever the device."""
    return n % FP8_BLOCK == 0 and k % (4 * FP8_BLOCK) == 0


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                     act: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """quant + cuBLAS's block-scaled GEMM; act: x's FP8 copy with outer-dim-major scales (`cached_fp8_m_major`,
    rows a multiple of CUBLAS_M), used as it is."""
    m = x.shape[0]
    a, a_s = act if act is not None else quant_act_fp8(x, pad_m_to=CUBLAS_M, scale_m_major=True)
    y = cublaslt_tuning.linear(a, a_s, weight, scale)  # the algorithm timed fastest at start-up, where one was
    y = torch._scaled_mm(a, weight.t(), scale_a=a_s, scale_b=scale.t(), out_dtype=torch.bfloat16) if y is None else y
    return y[:m].to(out_dtype)


# 33-64-row projections whose 128-row tiles fill under one wave take the split-K GEMM (`gluon_fp8_splitk`), not
# cuBLAS's one tile a CTA over the whole K: H200, 64 rows, 1.16-1.29x of `_scaled_mm` on the same operands where K
# >= 4096, 0.53-0.92x at 128 rows (bench/RESULTS.md, fortieth session; profile_decode --ab no_splitk / splitk:...).
SPLITK_GEMM = True
SPLITK_ROWS = (SMALL_M + 1, 64)  # below, the skinny kernels; above, it loses to cuBLAS
SPLITK_MIN_K = 4096


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                  act: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor | None:
    """`fp8_linear`'s cuBLAS case where the split-K GEMM takes it (SPLITK_ROWS rows, K >= SPLITK_MIN_K and
    `choose_split` >= 2) on a Hopper GPU, else None (the caller runs cuBLAS). act: x's FP8 copy with outer-dim-major
    scales, else x is quantised (unpadded). A launch on a high-priority stream (the step's side stream: the shared
    expert) counts its arrivals apart from the compute stream's, which may run one beside it."""
    m, k = x.shape
    if not SPLITK_GEMM or not SPLITK_ROWS[0] <= m <= SPLITK_ROWS[1] or k < SPLITK_MIN_K:
        return None
    if not gluon_fp8_splitk.available(x.device) or not gluon_fp8_splitk.tma_ok(weight):
        return None
    split = gluon_fp8_splitk.choose_split(weight.shape[0], k, num_sms(x.device.index))
    if split < 2:
        return None
    a, a_s = act if act is not None else quant_act_fp8(x, scale_m_major=True)
    a, a_s = a[:m], a_s[:m]
    if not gluon_fp8_splitk.tma_ok(a):
        return None
    return gluon_fp8_splitk.fp8_splitk_gemm(a, a_s, weight, scale, split, out_dtype,
                                            side_stream=bool(on_side_stream(x.device)))


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_linear: x has K={x.shape[-1]}, weight is {tuple(weight.shape)}")
    want = (triton.cdiv(weight.shape[0], FP8_BLOCK), triton.cdiv(weight.shape[1], FP8_BLOCK))
    if tuple(scale.shape) != want:
        raise ValueError(f"fp8_linear: weight_scale_inv is {tuple(scale.shape)}, expected {want}")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor,
               exact_act: bool = False) -> torch.Tensor:
    """GPU `reference.fp8_linear`: y = x @ dequant(W)^T, x [M, K] -> [M, N] in x.dtype.

    exact_act keeps activations as they are (FP8 weight tiles widened in registers; ~1.4x slower at decode): bf16
    ones on the tensor cores, the reference's numbers up to bf16 rounding; float32 ones (a float32 model, the
    float32 comparisons of `dsaserve eval`) in float32 with IEEE products, the reference's up to summation order.
    For comparisons with the CPU path (bench/logit_distance.py, tests/quality/test_gpu_vs_cpu.py).
    """
    _check(x, weight, weight_scale_inv)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n, k = x2.shape[0], weight.shape[0], weight.shape[1]
    if m == 0:  # no tokens (an EP / DP-attention rank with nothing this step): no launch, no tile arithmetic
        return x.new_empty(*lead, n)
    if exact_act:
        if m <= SKINNY_MAX_M:
            cfg = dict(skinny_config(m, n, k, _sm_count(x2)), a_fp8=False, block_n=64)
            y = skinny_gemm(x2, weight, weight_scale_inv, out_dtype=x.dtype, **cfg)
        else:
            y = triton_gemm(x2, weight, weight_scale_inv, False, 64, 128, 1, 4, 3, x.dtype)
    elif m <= SMALL_M or (m <= SKINNY_MAX_M and not scaled_mm_ok(n, k, x2.device)):
        cfg = skinny_config(m, n, k, _sm_count(x2))
        y = skinny_gemm(x2, weight, weight_scale_inv, out_dtype=x.dtype, act=cached_fp8(x), **cfg)
    elif scaled_mm_ok(n, k, x2.device):
        y = splitk_linear(x2, weight, weight_scale_inv, x.dtype, cached_fp8_m_major(x))
        if y is None:
            y = scaled_mm_linear(x2, weight, weight_scale_inv, x.dtype, act=cached_fp8_m_major(x))
    else:
        y = triton_gemm(x2, weight, weight_scale_inv, True, 64, 128, 1, 4, 3, x.dtype)
    return y.reshape(*lead, n)
