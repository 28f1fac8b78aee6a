"""GPU fused MoE: `fused_moe` and `moe_route` (request path stage 6, the routed experts of MoE layers).

Owns: the GPU variant of `reference.fused_moe` and the token sort it needs. One call is
  1. align: the T*k (token, expert) pairs sorted by expert, each expert's run padded to BLOCK_M, so every
     M-block of the grouped GEMM belongs to one expert (SGLang's `moe_align_block_size`, here in torch ops
     with static sizes: no host sync, no data-dependent shape, so it is CUDA-graph capturable);
  2. GEMM1 (Triton, grouped): for each block, gate and up tiles of the expert's w13 at once, SiLU(gate)*up
     in the epilogue -> act [T*k, I] (gate/up never reach memory);
  3. GEMM2 (Triton, grouped): act @ w2[e]^T scaled by the pair's routing weight -> [T*k, H];
  4. combine: the k rows of each token summed (one reduction; no atomics, so results are deterministic).
FP8 experts: activations quantised per (token, 128-group) to e4m3 and FP8 tensor-core dots; decode-size
batches use the swap-AB kernel (expert weight rows as the MMA's M), prefill the A-operand one. Dense
(bf16) experts keep bf16 activations.
`moe_route` is the reference's torch code: it is already graph-capturable (static-size topk/scatter).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels import reference
from dsaserve.kernels.triton_fp8_gemm import FP8_BLOCK, quant_act_fp8

PREFILL_MIN_PAIRS = 4096  # T*k pairs from which the A-operand (prefill) kernel replaces the swap-AB one

moe_route = reference.moe_route


def moe_align(topk_ids: torch.Tensor, num_experts: int,
              block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort pairs by expert and pad each expert's run to a multiple of block_m (static output sizes).

    Returns sorted_ids [max_blocks * block_m] int32 (pair index t*k+j, or T*k for padding), expert of each
    block [max_blocks] int32, and the padded total [1] int32 (blocks at or past it are skipped).
    """
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    max_blocks = triton.cdiv(n + num_experts * (block_m - 1), block_m)
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pcum = padded.cumsum(0)
    start = counts.cumsum(0) - counts
    sorted_e, order = torch.sort(flat, stable=True)
    rank = torch.arange(n, device=dev) - start[sorted_e]
    dest = (pcum - padded)[sorted_e] + rank
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(max_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pcum, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, pcum[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tw_ptr, sorted_ptr, bexp_ptr, total_ptr,
                     N, K, num_pairs, a_row_div, up_offset,
                     stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk,
                     stride_cm,
                     GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, A_FP8: tl.constexpr, B_SCALED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair, n] = sum_k A[pair // a_row_div, k] * W_e[n, k] over the pairs of one expert block.

    GATED: W_e rows [n] (gate) and [up_offset + n] (up), C = silu(gate) * up. MUL_WEIGHT: C *= tw[pair].
    """
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
        else:
            a = a.to(tl.bfloat16)
        b = tl.load(g_ptrs + kb * BLOCK_K, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if not A_FP8:
            b = b.to(tl.bfloat16)
        part = tl.dot(a, b)
        if B_SCALED:
            part = part * tl.load(gs_ptrs + kb * stride_bsk, mask=nmask, other=0.0)[None, :]
        if A_FP8:
            part = part * a_s[:, None]
        acc_g += part
        if GATED:
            b = tl.load(u_ptrs + kb * BLOCK_K, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if not A_FP8:
                b = b.to(tl.bfloat16)
            part = tl.dot(a, b)
            if B_SCALED:
                part = part * tl.load(us_ptrs + kb * stride_bsk, mask=nmask, other=0.0)[None, :]
            if A_FP8:
                part = part * a_s[:, None]
            acc_u += part
    if GATED:
        acc_g = acc_g * tl.sigmoid(acc_g) * acc_u
    if MUL_WEIGHT:
        acc_g = acc_g * tl.load(tw_ptr + pairs, mask=pmask, other=0.0)[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc_g.to(c_ptr.dtype.element_ty), mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _moe_skinny_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tw_ptr, sorted_ptr, bexp_ptr, total_ptr,
                       N, K, num_pairs, a_row_div, up_offset,
                       stride_am, stride_asm, stride_ask, stride_be, stride_bn, stride_bse, stride_bsn, stride_bsk,
                       stride_cm, GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, B_SCALED: tl.constexpr,
                       A_FP8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode variant of `_moe_gemm_kernel`: the expert's weight rows are the MMA's A operand (swap-AB,
    acc^T [BN, BM]), read row-major with 16-byte loads; widened to bf16 in registers (bf16 activations)
    or fed as FP8 (A_FP8: activations quantised per (token, 128), both scales on each K step's sum)."""
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
        else:
            a = a.to(tl.bfloat16)
        a = tl.trans(a)
        w = tl.load(g_ptrs + kb * BLOCK_K, mask=nmask[:, None] & kmask[None, :], other=0.0)
        part = tl.dot(w if A_FP8 else w.to(tl.bfloat16), a)
        if B_SCALED:
            part = part * tl.load(gs_ptrs + kb * stride_bsk, mask=nmask, other=0.0)[:, None]
        if A_FP8:
            part = part * a_s
        acc_g += part
        if GATED:
            w = tl.load(u_ptrs + kb * BLOCK_K, mask=nmask[:, None] & kmask[None, :], other=0.0)
            part = tl.dot(w if A_FP8 else w.to(tl.bfloat16), a)
            if B_SCALED:
                part = part * tl.load(us_ptrs + kb * stride_bsk, mask=nmask, other=0.0)[:, None]
            if A_FP8:
                part = part * a_s
            acc_u += part
    if GATED:
        acc_g = acc_g * tl.sigmoid(acc_g) * acc_u
    if MUL_WEIGHT:
        acc_g = acc_g * tl.load(tw_ptr + pairs, mask=pmask, other=0.0)[None, :]
    c_ptrs = c_ptr + pairs.to(tl.int64)[None, :] * stride_cm + offs_n[:, None]
    tl.store(c_ptrs, acc_g.to(c_ptr.dtype.element_ty), mask=pmask[None, :] & nmask[:, None])


def _block_m(pairs: int, experts: int) -> int:
    per_expert = pairs / max(experts, 1)
    return 16 if per_expert <= 16 else (32 if per_expert <= 32 else 64)


def _grouped_gemm(a, a_s, w, w_s, out, tw, sorted_ids, bexp, total, n, k, a_row_div, gated, block_m, block_n,
                  num_warps, num_stages, swap):
    grid = (triton.cdiv(n, block_n), sorted_ids.numel() // block_m)
    a_fp8 = a.dtype == torch.float8_e4m3fn
    scaled = w_s is not None
    if swap:
        _moe_skinny_kernel[grid](
            a, a_s if a_fp8 else a, w, w_s if scaled else w, out, tw if tw is not None else out, sorted_ids, bexp,
            total, n, k, out.shape[0], a_row_div, n if gated else 0, a.stride(0), a_s.stride(0) if a_fp8 else 0,
            a_s.stride(1) if a_fp8 else 0, w.stride(0), w.stride(1),
            w_s.stride(0) if scaled else 0, w_s.stride(1) if scaled else 0, w_s.stride(2) if scaled else 0,
            out.stride(0), GATED=gated, MUL_WEIGHT=tw is not None, B_SCALED=scaled, A_FP8=a_fp8,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_BLOCK, num_warps=num_warps, num_stages=num_stages)
        return
    _moe_gemm_kernel[grid](
        a, a_s if a_fp8 else a, w, w_s if scaled else w, out, tw if tw is not None else out, sorted_ids, bexp, total,
        n, k, out.shape[0], a_row_div, n if gated else 0,
        a.stride(0), a_s.stride(0) if a_fp8 else 0, a_s.stride(1) if a_fp8 else 0,
        w.stride(0), w.stride(1), w_s.stride(0) if scaled else 0, w_s.stride(1) if scaled else 0,
        w_s.stride(2) if scaled else 0, out.stride(0),
        GATED=gated, MUL_WEIGHT=tw is not None, A_FP8=a_fp8, B_SCALED=scaled,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_BLOCK, num_warps=num_warps, num_stages=num_stages)


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


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
              w2_scale: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              config: dict | None = None) -> torch.Tensor:
    """GPU `reference.fused_moe`: x [T, H] -> sum_k w[t,k] * expert_{ids[t,k]}(x[t]) in x.dtype.

    `config` (bench/tuning only) overrides block_m / block_n / num_warps / num_stages / fp8_act / swap.
    """
    _check(x, w13, w13_scale, w2, w2_scale, topk_ids)
    t, top_k = topk_ids.shape
    e, two_i, h = w13.shape
    inter = two_i // 2
    pairs = t * top_k
    # H200 sweep (bench/RESULTS.md): decode = swap-AB kernel with FP8 activations (T=1: 150 us vs 195-250 us
    # for the bf16-activation kernels; T=32: 394 vs 494 us); prefill = A-operand kernel, 64x64 tiles
    cfg = {"block_m": _block_m(pairs, e), "block_n": 64, "num_warps": 4, "num_stages": 4, "swap": True,
           "fp8_act": w13_scale is not None}
    if pairs >= PREFILL_MIN_PAIRS:
        cfg.update(block_m=64, block_n=64, num_warps=4, num_stages=4, swap=False)
    cfg.update(config or {})
    bm, bn = cfg["block_m"], cfg["block_n"]
    launch = {"block_m": bm, "block_n": bn, "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
              "swap": cfg["swap"]}
    sorted_ids, bexp, total = moe_align(topk_ids, e, bm)
    x = x.contiguous()
    act_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    a, a_s = quant_act_fp8(x) if cfg["fp8_act"] else (x, None)
    act = torch.empty(pairs, inter, dtype=act_dtype, device=x.device)
    _grouped_gemm(a, a_s, w13, w13_scale, act, None, sorted_ids, bexp, total, inter, h, top_k, True, **launch)
    a, a_s = quant_act_fp8(act) if cfg["fp8_act"] else (act, None)
    out = torch.empty(pairs, h, dtype=act_dtype, device=x.device)  # per-pair rows, summed in fp32 below
    tw = topk_weights.reshape(-1).float().contiguous()
    _grouped_gemm(a, a_s, w2, w2_scale, out, tw, sorted_ids, bexp, total, h, inter, 1, False, **launch)
    return out.view(t, top_k, h).sum(1, dtype=torch.float32).to(x.dtype)
