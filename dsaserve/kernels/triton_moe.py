"""GPU fused MoE: `fused_moe` (request path stage 6, the routed experts of MoE layers).

Owns: the GPU variant of `reference.fused_moe` and the token sort it needs. One call is
  1. route: up to UNSORTED_MAX_PAIRS (token, expert) pairs (decode), each GEMM program finds its expert's
     pairs in registers (`_moe_unsorted_kernel`); above that, `moe_align` sorts the pairs by expert and
     pads each expert's run to BLOCK_M, so every M-block belongs to one expert (SGLang's
     `moe_align_block_size`: `triton_moe_align`, static sizes, CUDA-graph capturable);
  2. GEMM1 (Triton, grouped): for each block, gate and up tiles of the expert's w13 at once, SiLU(gate)*up
     in the epilogue -> act [T*k, I] (gate/up never reach memory);
  3. GEMM2 (Triton, grouped): act @ w2[e]^T scaled by the pair's routing weight -> [T*k, H];
  4. combine: the k rows of each token summed in fp32 (one kernel; no atomics: deterministic).
FP8 experts: activations quantised per (token, 128-group) to e4m3 and FP8 tensor-core dots; decode-size
batches use the swap-AB kernels (expert weight rows as the MMA's M), prefill (FP8 experts) the dense grouped
GEMMs over permuted rows of `triton_moe_prefill.py` (or the A-operand gather kernel, PREFILL_CONFIG["kernel"]).
Dense (bf16) experts keep bf16 activations. The router is `triton_moe_route.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.common import envs
from dsaserve.kernels.cublas_moe_prefill import moe_prefill_cublas, use_cublas
from dsaserve.kernels.reference import SharedExpert
from dsaserve.kernels.triton_fp8_gemm import FP8_BLOCK, cached_fp8, quant_act_fp8
from dsaserve.kernels.triton_moe_align import align_route
from dsaserve.kernels.triton_moe_prefill import PREFILL_CONFIG, _store_combined, moe_prefill_fp8
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

PREFILL_MIN_PAIRS = 4096  # T*k pairs from which the A-operand (prefill) kernel replaces the swap-AB one
UNSORTED_MAX_PAIRS = 256  # T*k pairs up to which the swap-AB kernel needs no moe_align (ids in registers)
# Decode batches of BUSY_EXPERT_PAIRS..2x that many pairs an expert (uniform routing): the A-operand kernel at 64 x
# 128 tiles takes the sorted path of FP8 experts. H200, 128 tokens over 32 experts: 397.3 vs the swap-AB kernel's
# 440.5 us (bench/RESULTS.md, twenty-fourth session). Busier experts (prefill chunks under PREFILL_MIN_PAIRS) keep
# the swap-AB kernel, unmeasured there, whose per-pair sums are the unsorted kernel's to the bit; bf16 experts' tiles
# so would need 320 KB of shared memory
# GEMM1 (gate and up, K = hidden) on 64-column tiles of 4 warps, GEMM2 (K = 2048) on 128 x 8 warps: H200, 128 tokens
# over 32 experts, 209.3 + 114.3 us against 216.7 + 114.3 with 128 x 8 warps for both (bench/probe_moe_b128.py,
# twenty-seventh session)
BUSY_EXPERT_PAIRS = 32
BUSY_CONFIG = {"kernel": "gemm", "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 4,
               "gemm2": {"block_n": 128, "num_warps": 8, "num_stages": 4}}


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort pairs by expert and pad each expert's run to a multiple of block_m (static output sizes).

    Returns sorted_ids [max_blocks * block_m] int32 (pair index t*k+j, or T*k for padding), expert of each
    block [max_blocks] int32, and the padded total [1] int32 (blocks at or past it are skipped). Pairs of id
    num_experts (an absent expert's, `fused_moe(absent=True)`) sort into one last run past the total: no
    GEMM block reads or writes them. An expert's pairs keep their order past `triton_moe_align.ONE_LAUNCH_PAIRS`
    pairs; up to it they fill the expert's run in no fixed order (no consumer depends on it).
    """
    return align_route(topk_ids, num_experts, block_m)[:3]


@triton.jit
def _weight_dot(a, a_s, b_ptrs, bs_ptrs, kmask, nmask, A_FP8: tl.constexpr, B_SCALED: tl.constexpr):
    """One K block of one weight half (gate or up), [BLOCK_M, BLOCK_N]: a @ W^T tile (read at b_ptrs, [BK, BN]),
    times the weight's 128-block scale of each column (B_SCALED) and the activations' of each row (A_FP8)."""
    b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
    if not A_FP8:
        b = b.to(a.dtype)
    part = tl.dot(a, b, input_precision="ieee" if a.dtype == tl.float32 else None)  # float32: not TF32
    if B_SCALED:
        part = part * tl.load(bs_ptrs, mask=nmask, other=0.0)[None, :]
    if A_FP8:
        part = part * a_s[:, None]
    return part


@triton.jit
def _weight_dot_swap(a_t, a_s, w_ptrs, ws_ptrs, kmask, nmask, A_FP8: tl.constexpr, B_SCALED: tl.constexpr):
    """`_weight_dot` swap-AB, [BLOCK_N, BLOCK_M]: the W tile (rows at w_ptrs, [BN, BK]) @ a^T, scaled per weight
    row (B_SCALED) and per activation column (A_FP8: a_s is [1, BLOCK_M])."""
    w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
    part = tl.dot(w if A_FP8 else w.to(a_t.dtype), a_t,
                  input_precision="ieee" if a_t.dtype == tl.float32 else None)  # float32: not TF32
    if B_SCALED:
        part = part * tl.load(ws_ptrs, mask=nmask, other=0.0)[:, None]
    if A_FP8:
        part = part * a_s
    return part


@triton.jit
def _moe_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tw_ptr, sorted_ptr, bexp_ptr, total_ptr,
                     N, K, num_pairs, a_row_div, up_offset,
                     stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk,
                     stride_cm,
                     GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_FP8: tl.constexpr, B_SCALED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """C[pair, n] = sum_k A[pair // a_row_div, k] * W_e[n, k] over the pairs of one expert block.

    GATED: W_e rows [n] (gate) and [up_offset + n] (up), C = silu(gate) * up. MUL_WEIGHT: C *= tw[pair].
    """
    grid_dependency_sync(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    rows = (pairs // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_base = b_ptr + e * stride_be + offs_k[:, None]
    g_ptrs = b_base + offs_n[None, :] * stride_bn
    u_ptrs = b_base + (offs_n + up_offset)[None, :] * stride_bn
    gs_ptrs = bs_ptr + e * stride_bse + (offs_n // 128) * stride_bsn
    us_ptrs = bs_ptr + e * stride_bse + ((offs_n + up_offset) // 128) * stride_bsn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = kb * BLOCK_K + offs_k < K
        a = tl.load(a_ptrs + kb * BLOCK_K, mask=pmask[:, None] & kmask[None, :], other=0.0)
        if A_FP8:
            a_s = tl.load(as_ptr + rows * stride_asm + kb * stride_ask, mask=pmask, other=0.0)
        else:  # exact activations: bf16, or a float32 model's float32 (eval's GPU-in-float32 comparison)
            if a_ptr.dtype.element_ty != tl.float32:
                a = a.to(tl.bfloat16)
            a_s = 1.0  # exact activations carry no scale (never read)
        acc_g += _weight_dot(a, a_s, g_ptrs + kb * BLOCK_K, gs_ptrs + kb * stride_bsk, kmask, nmask, A_FP8, B_SCALED)
        if GATED:
            acc_u += _weight_dot(a, a_s, u_ptrs + kb * BLOCK_K, us_ptrs + kb * stride_bsk, kmask, nmask, A_FP8,
                                 B_SCALED)
    if GATED:
        acc_g = acc_g * tl.sigmoid(acc_g) * acc_u
    if MUL_WEIGHT:
        acc_g = acc_g * tl.load(tw_ptr + pairs, mask=pmask, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc_g.to(c_ptr.dtype.element_ty), mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _expert_tile(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tw_ptr, e, pairs, pmask, pid_n, N, K, a_row_div, up_offset,
                 stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk,
                 stride_cm, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, B_SCALED: tl.constexpr,
                 A_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 row_base=0):
    """One [BLOCK_N] slice of expert e's output for up to BLOCK_M of its pairs, swap-AB: the expert's
    weight rows are the MMA's A operand (acc^T [BN, BM]), read row-major with 16-byte loads; pair p reads
    activation row (p - row_base) // a_row_div.
    A_FP8: activations quantised beforehand (`quant_act_fp8`, scales at as_ptr), else bf16 activations
    (the weight tiles widened)."""
    rows = ((pairs - row_base) // a_row_div).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    g_ptrs = b_ptr + e * stride_be + offs_n[:, None] * stride_bn + offs_k[None, :]
    u_ptrs = g_ptrs + up_offset * stride_bn
    gs_ptrs = bs_ptr + e * stride_bse + (offs_n // 128) * stride_bsn
    us_ptrs = bs_ptr + e * stride_bse + ((offs_n + up_offset) // 128) * stride_bsn
    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = kb * BLOCK_K + offs_k < K
        a = tl.load(a_ptrs + kb * BLOCK_K, mask=pmask[:, None] & kmask[None, :], other=0.0)
        if A_FP8:
            a_s = tl.load(as_ptr + rows * stride_asm + kb * stride_ask, mask=pmask, other=0.0)[None, :]
        else:  # exact activations: bf16, or a float32 model's float32 (eval's GPU-in-float32 comparison)
            if a_ptr.dtype.element_ty != tl.float32:
                a = a.to(tl.bfloat16)
            a_s = 1.0  # exact activations carry no scale (never read)
        a = tl.trans(a)
        acc_g += _weight_dot_swap(a, a_s, g_ptrs + kb * BLOCK_K, gs_ptrs + kb * stride_bsk, kmask, nmask, A_FP8,
                                  B_SCALED)
        if GATED:
            acc_u += _weight_dot_swap(a, a_s, u_ptrs + kb * BLOCK_K, us_ptrs + kb * stride_bsk, kmask, nmask, A_FP8,
                                      B_SCALED)
    if GATED:
        acc_g = acc_g * tl.sigmoid(acc_g) * acc_u
    if MUL_WEIGHT:
        acc_g = acc_g * tl.load(tw_ptr + pairs, mask=pmask, other=0.0)[None, :]
    c_ptrs = c_ptr + pairs.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
    tl.store(c_ptrs, acc_g.to(c_ptr.dtype.element_ty), mask=pmask[None, :] & nmask[:, None])


@triton.jit
def _moe_skinny_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tw_ptr, sorted_ptr, bexp_ptr, total_ptr,
                       N, K, num_pairs, a_row_div, up_offset,
                       stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk,
                       stride_cm, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, B_SCALED: tl.constexpr,
                       A_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       PAIRS_FASTEST: tl.constexpr = False, PDL: tl.constexpr = False):
    """Decode variant of `_moe_gemm_kernel` over `moe_align`'s expert blocks (`_expert_tile`). PAIRS_FASTEST: the
    grid's first axis is the pair blocks, so an expert's blocks that share a weight tile run side by side (its
    tile read from HBM once, then from L2) instead of one column of n-tiles apart."""
    grid_dependency_sync(PDL)
    if PAIRS_FASTEST:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    else:
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(bexp_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    _expert_tile(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tw_ptr, e, pairs, pairs < num_pairs, pid_n, N, K, a_row_div,
                 up_offset, stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn,
                 stride_bsk, stride_cm, GATED, MUL_WEIGHT, B_SCALED, A_FP8, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _moe_unsorted_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tw_ptr, ids_ptr, sh_b_ptr, sh_bs_ptr, N, K, num_pairs,
                         a_row_div, up_offset, num_tokens, shared_row_base, stride_am, stride_asm, stride_ask,
                         stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk, stride_cm,
                         GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, B_SCALED: tl.constexpr, A_FP8: tl.constexpr,
                         PAIRS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         SHARED: tl.constexpr = False, PDL: tl.constexpr = False):
    """Small decode batches without `moe_align`: program (n, e) finds expert e's pairs itself (all T*k ids
    fit in registers) and runs them BLOCK_M at a time; an expert nobody chose exits at once. Saves the
    align's 4 small launches per MoE layer, which at batch 1 cost more than the sort does work.
    SHARED: the last program column is the shared expert (weights at sh_b_ptr / sh_bs_ptr, laid out as one
    routed expert's): every token t as pair num_pairs + t, weight 1, activation row t - shared_row_base."""
    grid_dependency_sync(PDL)
    pid_n = tl.program_id(0)
    e = tl.program_id(1)
    if SHARED:  # noqa: SIM102 (a constexpr branch: the runtime test exists only in the SHARED variant)
        if e == tl.num_programs(1) - 1:
            for c0 in range(0, num_tokens, BLOCK_M):
                tok = c0 + tl.arange(0, BLOCK_M)
                _expert_tile(a_ptr, as_ptr, sh_b_ptr, sh_bs_ptr, c_ptr, tw_ptr, 0, num_pairs + tok, tok < num_tokens,
                             pid_n, N, K, 1, up_offset, stride_am, stride_asm, stride_ask, stride_be, stride_bn,
                             stride_bse, stride_bsn, stride_bsk, stride_cm, GATED, False, B_SCALED, A_FP8, BLOCK_M,
                             BLOCK_N, BLOCK_K, shared_row_base)
            return
    offs_p = tl.arange(0, PAIRS)
    hit = (tl.load(ids_ptr + offs_p, mask=offs_p < num_pairs, other=-1) == e).to(tl.int32)
    count = tl.sum(hit, axis=0)
    if count == 0:
        return
    rank = tl.cumsum(hit, axis=0) - 1  # a hit's place among expert e's pairs, in pair order
    for c0 in range(0, count, BLOCK_M):
        slot = c0 + tl.arange(0, BLOCK_M)
        pick = (hit[None, :] == 1) & (rank[None, :] == slot[:, None])
        pairs = tl.sum(tl.where(pick, offs_p[None, :], 0), axis=1)
        _expert_tile(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tw_ptr, e.to(tl.int64), pairs, slot < count, pid_n, N, K,
                     a_row_div, up_offset, stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse,
                     stride_bsn, stride_bsk, stride_cm, GATED, MUL_WEIGHT, B_SCALED, A_FP8, BLOCK_M, BLOCK_N, BLOCK_K)


@triton.jit
def _combine_k_kernel(x_ptr, y_ptr, add_ptr, H, TOP_K: tl.constexpr, BLOCK: tl.constexpr, HAS_ADD: tl.constexpr,
                      SHARED: tl.constexpr = False, PDL: tl.constexpr = False):
    """y[t] = sum_j x[t*k + j] in fp32, rounded once (the reference's sum(1, dtype=fp32).to(dtype)), then
    + add[t] rounded again as torch's add would (HAS_ADD: the shared expert's output, one launch fewer).
    SHARED: the shared expert's row (x[T*k + t], the unsorted kernel's) joins the fp32 sum."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(x_ptr + (t * TOP_K + j) * H + offs, mask=mask, other=0.0).to(tl.float32)
    if SHARED:
        acc += tl.load(x_ptr + (tl.num_programs(0) * TOP_K + t) * H + offs, mask=mask, other=0.0).to(tl.float32)
    _store_combined(acc, y_ptr, add_ptr, t, H, offs, mask, HAS_ADD)


def _block_m(pairs: int, experts: int) -> int:
    """The pair block of the swap-AB kernels (sorted and unsorted) by the mean pairs an expert: under 16 -> 16, up to
    32 -> 32, else 64. A mean of exactly 16 takes 32-pair blocks, so a routing's busier experts do not spill into a
    second block (H200, 64 tokens over 32 experts: 367.9 us against 388.6 with 16-pair blocks, bench/RESULTS.md
    twenty-fourth session)."""
    per_expert = pairs / max(experts, 1)
    return 16 if per_expert < 16 else (32 if per_expert <= 32 else 64)


def _grouped_gemm(a, a_s, w, w_s, out, tw, route, n, k, a_row_div, gated, block_m, block_n, num_warps, num_stages,
                  kernel, shared=None, shared_row_base=0, pairs_fastest=False):
    """One grouped GEMM over the (token, expert) pairs. route: topk_ids (kernel "unsorted") or moe_align's
    (sorted_ids, block_expert, total); a_s: the FP8 activations' scales, or None for bf16 activations.
    shared (kernel "unsorted"): (weight, scale) of the shared expert, run as one more expert whose pairs are the
    rows past the routed ones (`_moe_unsorted_kernel`'s SHARED)."""
    scaled, a_fp8 = w_s is not None, a_s is not None
    ws = (w_s.stride(0), w_s.stride(1), w_s.stride(2)) if scaled else (0, 0, 0)
    a_strides = (a.stride(0), a_s.stride(0) if a_fp8 else 0, a_s.stride(1) if a_fp8 else 0)
    common = dict(GATED=gated, MUL_WEIGHT=tw is not None, B_SCALED=scaled, A_FP8=a_fp8, BLOCK_M=block_m,
                  BLOCK_N=block_n, BLOCK_K=FP8_BLOCK, num_warps=num_warps, num_stages=num_stages)
    tw = tw if tw is not None else out
    w_s, a_s = (w_s if scaled else w), (a_s if a_fp8 else a)
    if kernel == "unsorted":
        ids = route.reshape(-1)
        sh_w, sh_s = shared if shared is not None else (w, w_s)
        grid = (triton.cdiv(n, block_n), w.shape[0] + (shared is not None))
        _moe_unsorted_kernel[grid](a, a_s, w, w_s, out, tw, ids, sh_w, sh_s, n, k, ids.numel(), a_row_div,
                                   n if gated else 0, out.shape[0] - ids.numel(), shared_row_base, *a_strides,
                                   w.stride(0), w.stride(1), *ws, out.stride(0),
                                   PAIRS=triton.next_power_of_2(ids.numel()), SHARED=shared is not None, **common,
                                   **pdl_args(a.device))
        return
    sorted_ids, bexp, total = route
    grid = (triton.cdiv(n, block_n), sorted_ids.numel() // block_m)
    args = (a, a_s, w, w_s, out, tw, sorted_ids, bexp, total, n, k, out.shape[0], a_row_div, n if gated else 0,
            *a_strides, w.stride(0), w.stride(1), *ws, out.stride(0))
    if kernel == "swap" and pairs_fastest:
        _moe_skinny_kernel[grid[::-1]](*args, **common, PAIRS_FASTEST=True, **pdl_args(a.device))
        return
    (_moe_skinny_kernel if kernel == "swap" else _moe_gemm_kernel)[grid](*args, **common, **pdl_args(a.device))


def _check(x, w13, w13_scale, w2, w2_scale, topk_ids):
    e, two_i, h = w13.shape
    if w2.shape != (e, h, two_i // 2):
        raise ValueError(f"fused_moe: w2 is {tuple(w2.shape)}, expected {(e, h, two_i // 2)} "
                         f"for w13 {tuple(w13.shape)}")
    if x.shape[-1] != h:
        raise ValueError(f"fused_moe: x has hidden {x.shape[-1]}, w13 expects {h}")
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("fused_moe: w13_scale and w2_scale must both be given (FP8) or both be None (dense)")
    if w13_scale is not None and (w13.dtype != torch.float8_e4m3fn or w2.dtype != torch.float8_e4m3fn):
        raise ValueError(f"fused_moe: scaled experts must be float8_e4m3fn, got {w13.dtype} / {w2.dtype}")
    if topk_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"fused_moe: topk_ids must be int32/int64, got {topk_ids.dtype}")


def launch_config(pairs: int, experts: int, fp8: bool, config: dict | None = None, absent: bool = False) -> dict:
    """`fused_moe`'s kernel and tiles for `pairs` (token, expert) pairs over `experts` local experts, `config` (the
    registry's fp8_act switch; benches and tuning) over them. H200 sweeps (bench/RESULTS.md): decode = swap-AB kernel
    with FP8 activations (T=1: 150 us vs 195-250 us for the bf16-activation kernels; T=32: 394 vs 494 us), up to
    UNSORTED_MAX_PAIRS finding each expert's pairs itself (no align launches); busy experts (BUSY_EXPERT_PAIRS) the
    A-operand kernel's wide tiles, measured with FP8 activations only, where the caller names no kernel and no
    pair is another rank's (`absent`: the pairs count other ranks' experts' too, so their mean here says nothing);
    prefill = the dense path (or the A-operand kernel, 64x64 tiles, for bf16 activations)."""
    config = config or {}
    fp8_act = fp8 and config.get("fp8_act", True)  # what the busy tiles and the dense path were measured with
    cfg = {"block_m": _block_m(pairs, experts), "block_n": 64, "num_warps": 4, "num_stages": 4, "fp8_act": fp8,
           "kernel": "unsorted" if pairs <= UNSORTED_MAX_PAIRS else "swap", "fuse_shared": True}
    busy = pairs > UNSORTED_MAX_PAIRS and BUSY_EXPERT_PAIRS * experts <= pairs < 2 * BUSY_EXPERT_PAIRS * experts
    if busy and fp8_act and "kernel" not in config and not absent:
        cfg.update(BUSY_CONFIG)
    if pairs >= PREFILL_MIN_PAIRS:
        cfg.update(block_m=64, block_n=64, num_warps=4, num_stages=4,
                   kernel=PREFILL_CONFIG["kernel"] if fp8_act else "gemm")
    if "gemm2" not in config and {"block_n", "num_warps", "num_stages"} & config.keys():
        cfg.pop("gemm2", None)  # the caller's tiles are both GEMMs'
    return {**cfg, **config}


def _shared_beside(shared: SharedExpert, x: torch.Tensor,
                   side: torch.cuda.Stream | None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """The shared expert's output (its module's own path: two cuBLAS GEMMs at batch 33-128) and, with a side
    stream, the event its work there ends at: it then overlaps the routed experts' launches (their GEMMs leave
    it SMs as their waves drain), where in line its under-filled GEMMs ran alone. H200, the slice's steps under
    overlap scheduling, beside against in line: batch 64 2.842-2.844 ms against 2.887-2.891, batch 128
    3.203-3.208 against 3.188-3.222: equal (bench/RESULTS.md, twenty-seventh session). The output is marked used
    by the current stream, so the allocator keeps its memory until that stream's combine has read it. Whether a
    graph capture then holds it to the capture's end is unconfirmed: on the H200 the peak allocation of 2 and of 10
    captured layers was the same (twenty-eighth session)."""
    if side is None:
        return shared.run(x), None
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        out = shared.run(x)
        ready = torch.cuda.Event()
        ready.record(side)
    out.record_stream(main)
    return out, ready


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
              w2_scale: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              add: torch.Tensor | None = None, config: dict | None = None, absent: bool = False,
              shared: SharedExpert | None = None, side_stream: torch.cuda.Stream | None = None) -> torch.Tensor:
    """GPU `reference.fused_moe`: x [T, H] -> sum_k w[t,k] * expert_{ids[t,k]}(x[t]) (+ add) in x.dtype.

    `config` (the registry's fp8_act switch; benches, tuning) overrides block_m / block_n / num_warps / num_stages /
    fp8_act / kernel ("unsorted" | "swap" | "gemm" | "dense") / fuse_shared / pairs_fastest ("swap": pair blocks
    first in the grid; H200, 128 tokens over all 32 experts: 422.7 vs 430.7 us, inside the spread; bench/RESULTS.md
    twentieth session); for "dense" (`triton_moe_prefill`, the FP8 prefill
    default when PREFILL_CONFIG["kernel"] says so) it overrides PREFILL_CONFIG's keys instead. `absent`: ids
    may be E (another rank's expert): no program computes those pairs (the unsorted kernel's experts never
    match E, `moe_align` sorts them past its total, the dense path's combine finds no row for them) and their
    rows of the per-pair output are zeros, so the combine adds nothing for them. `shared`: at decode sizes
    (the unsorted kernel) one more expert of both GEMMs, its row summed by the combine in fp32 with the routed
    ones (two skinny GEMMs and a SiLU launch fewer a layer); elsewhere `shared.run` (its module's own path), added.
    `config["gemm2"]`: GEMM2's own block_n / num_warps / num_stages (its K is the expert width, not hidden).
    `side_stream`: where a shared expert that is not fused runs (`_shared_beside`), beside the expert sort and the
    routed GEMMs, joined before the combine (config "shared_beside": False keeps it in line).
    """
    _check(x, w13, w13_scale, w2, w2_scale, topk_ids)
    t, top_k = topk_ids.shape
    e, two_i, h = w13.shape
    inter = two_i // 2
    pairs = t * top_k
    fp8 = w13_scale is not None
    cfg = launch_config(pairs, e, fp8, config, absent)
    add_ready = None
    if shared is not None:
        if add is not None:
            raise ValueError("fused_moe: give the shared expert as `shared` or its output as `add`, not both")
        fuse = (cfg["fuse_shared"] and cfg["kernel"] == "unsorted" and fp8 and cfg["fp8_act"] and pairs > 0
                and all(sh.shape == w.shape[1:] and sh.stride() == w.stride()[1:]  # read with the experts' strides
                        for sh, w in zip(shared[:4], (w13, w13_scale, w2, w2_scale), strict=True)))
        if not fuse:  # beside: only where the combine below reads it (it waits there)
            beside_ok = cfg.get("shared_beside", True) and cfg["kernel"] != "dense" and pairs > 0 and x.is_cuda
            beside = side_stream if beside_ok else None
            (add, add_ready), shared = _shared_beside(shared, x, beside), None
    if cfg["kernel"] == "dense":  # dense grouped GEMMs over permuted rows (FP8 experts, FP8 activations)
        if not (fp8 and cfg["fp8_act"]):
            raise ValueError("fused_moe: kernel 'dense' needs FP8 experts and FP8 activations")
        gemm = envs.DSASERVE_MOE_PREFILL_GEMM
        dense = {**PREFILL_CONFIG, **({"gemm": gemm} if gemm else {}), **(config or {})}
        if pairs == 0:
            return torch.empty(t, h, dtype=x.dtype, device=x.device) if add is None else add.clone()
        route = align_route(topk_ids, e, dense["block_m"])  # with pos: the dense path's un-permutation
        prefill = moe_prefill_cublas if use_cublas(dense, x, e, inter, pairs) else moe_prefill_fp8
        return prefill(x.contiguous(), w13, w13_scale, w2, w2_scale, topk_weights, route, top_k, add, dense)
    bm, bn, kernel = cfg["block_m"], cfg["block_n"], cfg["kernel"]
    launch = {"block_m": bm, "block_n": bn, "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
              "kernel": kernel, "pairs_fastest": cfg.get("pairs_fastest", False)}
    launch2 = {**launch, **cfg.get("gemm2", {}), "block_m": bm}  # GEMM2's own tiles over the same expert blocks
    if pairs == 0:
        return torch.empty(t, h, dtype=x.dtype, device=x.device) if add is None else add.clone()
    route = topk_ids.contiguous() if kernel == "unsorted" else moe_align(topk_ids, e, bm)
    x = x.contiguous()  # the same tensor when contiguous: keeps its FP8 copy (`cached_fp8`)
    # a float32 model's exact path keeps float32 between the GEMMs (eval's GPU-in-float32 comparison)
    act_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) or not cfg["fp8_act"] else torch.bfloat16

    def activations(v: torch.Tensor):  # (a, scales): FP8 per (token, 128) for FP8 experts
        return (cached_fp8(v) or quant_act_fp8(v)) if fp8 and cfg["fp8_act"] else (v, None)

    rows = pairs + (t if shared is not None else 0)  # the shared expert's rows after the routed pairs
    sh13, sh2 = ((shared.w13, shared.w13_scale), (shared.w2, shared.w2_scale)) if shared is not None else (None, None)
    act = torch.empty(rows, inter, dtype=act_dtype, device=x.device)
    _grouped_gemm(*activations(x), w13, w13_scale, act, None, route, inter, h, top_k, True, **launch, shared=sh13,
                  shared_row_base=pairs)
    # per-pair rows, summed in fp32 below; absent pairs' rows are never written: zeros
    out = (torch.zeros if absent else torch.empty)(rows, h, dtype=act_dtype, device=x.device)
    tw = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(*activations(act), w2, w2_scale, out, tw, route, h, inter, 1, False, **launch2, shared=sh2)
    y = torch.empty(t, h, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(h), 1024)
    if add_ready is not None:
        torch.cuda.current_stream().wait_event(add_ready)
    add = add.contiguous() if add is not None else None
    _combine_k_kernel[(t, triton.cdiv(h, block))](out, y, y if add is None else add, h, TOP_K=top_k, BLOCK=block,
                                                  HAS_ADD=add is not None, SHARED=shared is not None,
                                                  **pdl_args(out.device))
    return y
