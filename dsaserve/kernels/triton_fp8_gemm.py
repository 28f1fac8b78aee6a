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
def _quant_group_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
                        GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr):
    m = tl.program_id(0)
    g0 = tl.program_id(1) * GROUPS_PER_PROG
    offs_g = g0 + tl.arange(0, GROUPS_PER_PROG)
    offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    kmask = offs_k < K
    x = tl.load(x_ptr + m * stride_xm + offs_k, mask=kmask & (m < M), other=0.0).to(tl.float32)
    # same rule as kv_pool._quant_fp8: scale = max(amax, 1e-12) / 448, padding rows quantise to zeros
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / FP8_MAX_C
    q = tl.clamp(x / scale[:, None], -FP8_MAX_C, FP8_MAX_C).to(tl.float8e4nv)
    tl.store(q_ptr + m * stride_qm + offs_k, q, mask=kmask)
    tl.store(s_ptr + m * stride_sm + offs_g * stride_sk, scale, mask=offs_g * GROUP < K)


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
    gpp = 4 if kg >= 4 else 1
    if mp > 0:
        _quant_group_kernel[(mp, triton.cdiv(kg, gpp))](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0),
                                                       s.stride(1), GROUP=FP8_BLOCK, GROUPS_PER_PROG=gpp)
    return q, s


# ---- the Triton block-scaled GEMM (skinny decode path; FP8-activation fallback for odd shapes) ---------
@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, kb_per_split, n_kb,
                     stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cs, stride_cm,
                     A_FP8: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of W [N, K]
    bs_ptrs = bs_ptr + (offs_n // 128) * stride_bsn
    kb0 = pid_s * kb_per_split
    kb1 = tl.minimum(kb0 + kb_per_split, n_kb)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(kb0, kb1):
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
        else:
            acc += tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16)) * bs[None, :]
    c_ptrs = c_ptr + pid_s * stride_cs + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


@triton.jit
def _fp8_skinny_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K, kb_per_split, n_kb,
                       stride_am, stride_asm, stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cs, stride_cm,
                       FMA: tl.constexpr, A_FP8: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Decode GEMM with the weight as the row operand: C^T [BN, BM] = W [BN, BK] @ x^T [BK, BM] per K step.

    W tiles are read row-major (K contiguous, 16-byte loads) and widened to bf16 in registers, where the
    tensor cores take them as the A operand (swap-AB: the tiny token count is the MMA's N). FMA=True
    (BLOCK_M == 1) skips the tensor cores: an elementwise fp32 multiply-accumulate reduced once at the end.
    A_FP8: x comes quantised per (token, 128) (`quant_act_fp8`) and the FP8 tiles go to the tensor cores
    as they are (no widening), the two scales applied to each K step's partial sums.
    """
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
    kb0 = pid_s * kb_per_split
    kb1 = tl.minimum(kb0 + kb_per_split, n_kb)
    if FMA:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for kb in range(kb0, kb1):
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
        else:
            acc += tl.dot(w.to(tl.bfloat16), tl.trans(a.to(tl.bfloat16))) * bs[:, None]
    if FMA:
        acc = tl.sum(acc2, axis=1)[:, None]
    c_ptrs = c_ptr + pid_s * stride_cs + offs_m[None, :] * stride_cm + offs_n[:, None]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=nmask[:, None] & mmask[None, :])


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fma: bool, block_m: int, block_n: int,
                split: int, num_warps: int, num_stages: int, out_dtype: torch.dtype,
                a_fp8: bool = False) -> torch.Tensor:
    """Decode path (`_fp8_skinny_kernel`) with an explicit tile config; fma needs block_m == 1."""
    m, k = x.shape
    n = weight.shape[0]
    a, a_s = quant_act_fp8(x) if a_fp8 else (x, x)
    kblocks = triton.cdiv(k, FP8_BLOCK)
    kb_per_split = triton.cdiv(kblocks, split)
    split = triton.cdiv(kblocks, kb_per_split)
    c = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else out_dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _fp8_skinny_kernel[grid](a, a_s, weight, scale, c, m, n, k, kb_per_split, kblocks, a.stride(0),
                             a_s.stride(0) if a_fp8 else 0, a_s.stride(1) if a_fp8 else 0, weight.stride(0),
                             scale.stride(0), scale.stride(1), c.stride(0), c.stride(1), FMA=fma, A_FP8=a_fp8,
                             EVEN_K=(k % FP8_BLOCK == 0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_BLOCK,
                             num_warps=num_warps, num_stages=num_stages)
    return c[0] if split == 1 else c.sum(0).to(out_dtype)


def skinny_config(m: int, n: int, k: int, sms: int) -> dict:
    """Tile choice for the decode path (BLOCK_K = 128 = the scale block, so one scale per K step).

    FP8 activations (swap-AB on FP8 tensor cores): measured faster than both bf16-activation variants
    (widening FP8 weights to bf16 in registers capped them near 2.2 TB/s) at every decode shape.
    """
    fma = False
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 128 if m > 32 else 64  # sweep at M = 64: 128-wide tiles 42.0 us, 64-wide 45.4 us
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, block_m)
    kblocks = triton.cdiv(k, FP8_BLOCK)
    # split K when the N tiles alone leave SMs idle (small N: kv_a 576, indexer wk 128)
    split = max(1, min(kblocks // 2, triton.cdiv(2 * sms, tiles))) if tiles < sms else 1
    return {"fma": fma, "a_fp8": True, "block_m": block_m, "block_n": block_n, "split": split, "num_warps": 4,
            "num_stages": 4}


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
    kb_per_split = triton.cdiv(kblocks, split)
    split = triton.cdiv(kblocks, kb_per_split)
    c = torch.empty(split, m, n, dtype=torch.float32 if split > 1 else out_dtype, device=x.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _fp8_gemm_kernel[grid](a, a_s, weight, scale, c, m, n, k, kb_per_split, kblocks,
                           a.stride(0), a_s.stride(0) if a_fp8 else 0, a_s.stride(1) if a_fp8 else 0,
                           weight.stride(0), scale.stride(0), scale.stride(1), c.stride(0), c.stride(1),
                           A_FP8=a_fp8, EVEN_K=(k % FP8_BLOCK == 0), BLOCK_M=block_m, BLOCK_N=block_n,
                           BLOCK_K=FP8_BLOCK, num_warps=num_warps, num_stages=num_stages)
    return c[0] if split == 1 else c.sum(0).to(out_dtype)


def scaled_mm_ok(n: int, k: int, device: torch.device) -> bool:
    """cuBLAS block scaling (1x128 x 128x128) on Hopper; other shapes/devices use the Triton kernel."""
    return (device.type == "cuda" and n % FP8_BLOCK == 0 and k % FP8_BLOCK == 0
            and torch.cuda.get_device_capability(device) == (9, 0))


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    m = x.shape[0]
    a, a_s = quant_act_fp8(x, pad_m_to=16, scale_m_major=True)
    y = torch._scaled_mm(a, weight.t(), scale_a=a_s, scale_b=scale.t(), out_dtype=torch.bfloat16)
    return y[:m].to(out_dtype)


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

    exact_act keeps activations bf16 (FP8 weight tiles widened in registers; ~1.4x slower at decode): the
    reference's numbers up to bf16 rounding, for greedy-equality checks against the CPU path.
    """
    _check(x, weight, weight_scale_inv)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n, k = x2.shape[0], weight.shape[0], weight.shape[1]
    if exact_act:
        if m <= SKINNY_MAX_M:
            cfg = dict(skinny_config(m, n, k, _sm_count(x2)), a_fp8=False, block_n=64)
            y = skinny_gemm(x2, weight, weight_scale_inv, out_dtype=x.dtype, **cfg)
        else:
            y = triton_gemm(x2, weight, weight_scale_inv, False, 64, 128, 1, 4, 3, x.dtype)
    elif m <= SMALL_M or (m <= SKINNY_MAX_M and not scaled_mm_ok(n, k, x2.device)):
        cfg = skinny_config(m, n, k, _sm_count(x2))
        y = skinny_gemm(x2, weight, weight_scale_inv, out_dtype=x.dtype, **cfg)
    elif scaled_mm_ok(n, k, x2.device):
        y = scaled_mm_linear(x2, weight, weight_scale_inv, x.dtype)
    else:
        y = triton_gemm(x2, weight, weight_scale_inv, True, 64, 128, 1, 4, 3, x.dtype)
    return y.reshape(*lead, n)
