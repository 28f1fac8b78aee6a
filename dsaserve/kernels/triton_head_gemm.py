"""GPU per-head GEMM of weight-absorbed MLA at decode: q_nope @ W_uk and latent @ W_uv (request path stage 6).

Owns: the GPU variant of `reference.head_bmm` for up to SMALL_M tokens (larger batches keep cuBLAS's
bmm). At decode each head's product is a GEMV over its own bf16 weight slice (GLM-5.3: W_uk 64 x 192 x 512
and W_uv 64 x 512 x 256 = 29 MB per layer), so the op is a weight stream. As a Triton kernel it joins the
step's PDL chain (`triton_utils`) where cuBLAS's kernels broke it, writes [T, H, N] contiguous (no copy
before o_proj), and, for the W_uv product, emits o_proj's FP8 input copy (`attach_fp8`): one program
holds a whole 128-column quantisation group, so the quantiser launch before o_proj goes away; and, when sparse
MLA left a 1-2-token call's split partials on the latent (`triton_sparse_mla.attach_splits`), merges them as it
reads them (their combine launch goes away), each K block's partials loaded into registers while the block before
multiplies.
Imported only by `kernels/registry.py` after it checked that Triton and a CUDA device are there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_fp8_gemm import FP8_BLOCK, FP8_MAX_C, SMALL_M, attach_fp8
from dsaserve.kernels.triton_sparse_mla import FOLD_MAX_T, pending_splits, split_weights, take_splits
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

# W_uv's fold loads each K block's split partials into registers a block ahead, under the block before's weights
# and dot (False: in their own block, which Triton's pipeliner stages through shared memory: 75.8 KB of it a program
# at one token, 100.4 at two, against 51.2; H100, 8-12 us a batch-1 step slower, bench/RESULTS.md thirty-seventh
# session; bench/profile_decode.py's "fold_in_block")
FOLD_PREFETCH = True


@triton.jit
def _split_tiles(part_ptr, t, h, k0, n_splits, K, stride_ps, stride_pt, stride_ph, offs_k, BLOCK_S: tl.constexpr):
    """Token t's, head h's partials over the splits at columns k0 + offs_k, [BLOCK_S, BLOCK_K] fp32 (0 past the splits
    and past K). A dead split's rows are read as they lie (never written) and weighed 0 by `_merged_block`, so the
    load need not wait for the merge weights."""
    offs_s = tl.arange(0, BLOCK_S)
    return tl.load(part_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph + k0 + offs_k[None, :],
                   mask=(offs_s < n_splits)[:, None] & (k0 + offs_k < K)[None, :], other=0.0)


@triton.jit
def _token_tiles(part_ptr, h, k0, n_splits, K, stride_ps, stride_pt, stride_ph, offs_k, BLOCK_S: tl.constexpr,
                 FOLD: tl.constexpr):
    """(token 0's, token FOLD - 1's) split tiles of K block k0 (`_split_tiles`): one tile, twice, at one token."""
    p0 = _split_tiles(part_ptr, 0, h, k0, n_splits, K, stride_ps, stride_pt, stride_ph, offs_k, BLOCK_S)
    if FOLD == 2:
        p1 = _split_tiles(part_ptr, 1, h, k0, n_splits, K, stride_ps, stride_pt, stride_ph, offs_k, BLOCK_S)
    else:
        p1 = p0
    return p0, p1


@triton.jit
def _merged_block(tiles0, tiles1, w0, w1, offs_t, FOLD: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_K: tl.constexpr, dtype):
    """A K block of a head's merged latent, [BLOCK_T, BLOCK_K] in `dtype`, from its tokens' split tiles: each of the
    FOLD tokens' rows rounded once, as the combine kernel stores them (a dead split weighs 0, whatever it holds)."""
    x = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for tt in tl.static_range(FOLD):
        w = w0 if tt == 0 else w1
        tile = tiles0 if tt == 0 else tiles1
        row = tl.sum(tl.where((w > 0)[:, None], tile, 0.0) * w[:, None], axis=0).to(dtype).to(tl.float32)
        x = tl.where(offs_t[:, None] == tt, row[None, :], x)
    return x.to(dtype)


@triton.jit
def _head_gemm_kernel(x_ptr, w_ptr, y_ptr, q_ptr, qs_ptr, part_ptr, lse_ptr, T, K, N, n_splits, stride_xt, stride_xh,
                      stride_wh, stride_wk, stride_ps, stride_pt, stride_ph, stride_ls, stride_lt,
                      QUANT: tl.constexpr, FOLD: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr = True,
                      PDL: tl.constexpr = False):
    """y[t, h, n] = sum_k x[t, h, k] * w[h, k, n]; program (h, n-block). y is [T, H*N] contiguous; QUANT
    (BLOCK_N == 128, N % 128 == 0): also its e4m3 copy + one fp32 scale per (token, 128 columns). FOLD (1-2: T): x
    is not read; its rows are merged from sparse MLA's split partials [S, T, H, K] and log-sum-exps [S, T, H], each K
    block's partials loaded a block ahead (PREFETCH) or in their block."""
    tl.static_assert(FOLD <= 2, "FOLD: 1-2 tokens (w0, w1)")
    grid_dependency_sync(PDL)
    h = tl.program_id(0).to(tl.int64)
    nb = tl.program_id(1)
    hn = tl.num_programs(0) * N
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tmask = offs_t < T
    nmask = offs_n < N
    x_ptrs = x_ptr + offs_t[:, None] * stride_xt + h * stride_xh + offs_k[None, :]
    w_ptrs = w_ptr + h * stride_wh + offs_k[:, None] * stride_wk + offs_n[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    if FOLD > 0:
        w0 = split_weights(lse_ptr, 0, h, n_splits, stride_ls, stride_lt, BLOCK_S)
        w1 = split_weights(lse_ptr, FOLD - 1, h, n_splits, stride_ls, stride_lt, BLOCK_S)
        p0, p1 = _token_tiles(part_ptr, h, 0, n_splits, K, stride_ps, stride_pt, stride_ph, offs_k, BLOCK_S, FOLD)
    for k0 in range(0, K, BLOCK_K):
        kmask = k0 + offs_k < K
        if FOLD > 0:
            if not PREFETCH:  # this block's partials loaded here (the pipeliner stages them in shared memory)
                p0, p1 = _token_tiles(part_ptr, h, k0, n_splits, K, stride_ps, stride_pt, stride_ph, offs_k, BLOCK_S,
                                      FOLD)
            x = _merged_block(p0, p1, w0, w1, offs_t, FOLD, BLOCK_T, BLOCK_K, x_ptr.dtype.element_ty)
            if PREFETCH:  # the next block's partials in flight, in registers, under this block's weight tile and dot
                p0, p1 = _token_tiles(part_ptr, h, k0 + BLOCK_K, n_splits, K, stride_ps, stride_pt, stride_ph, offs_k,
                                      BLOCK_S, FOLD)
        else:
            x = tl.load(x_ptrs + k0, mask=tmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0 * stride_wk, mask=kmask[:, None] & nmask[None, :], other=0.0)
        # float32 operands (a float32 model: eval's GPU-in-float32 comparison) as IEEE products, not TF32
        acc += tl.dot(x, w, input_precision="ieee" if w_ptr.dtype.element_ty == tl.float32 else None)
    y = acc.to(y_ptr.dtype.element_ty)
    col = h * N + offs_n
    tl.store(y_ptr + offs_t[:, None] * hn + col[None, :], y, mask=tmask[:, None] & nmask[None, :])
    if QUANT:  # `quant_act_fp8`'s rule on the rounded output, its [T, H*N] / [T, H*N/128] layout
        yf = y.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(yf), axis=1), 1e-12) / FP8_MAX_C
        q = tl.clamp(yf / scale[:, None], -FP8_MAX_C, FP8_MAX_C).to(tl.float8e4nv)
        tl.store(q_ptr + offs_t[:, None] * hn + col[None, :], q, mask=tmask[:, None])
        tl.store(qs_ptr + offs_t * (hn // 128) + (h * N + nb * BLOCK_N) // 128, scale, mask=tmask)


def head_bmm(x: torch.Tensor, w: torch.Tensor, flatten: bool = False) -> torch.Tensor:
    """GPU `reference.head_bmm`: x [T, H, K] (any strides, last one 1) @ w [H, K, N] -> [T, H, N], or
    [T, H*N] with flatten (then, at decode size, carrying its FP8 copy for the next GEMM)."""
    t, h, k = x.shape
    n = w.shape[2]
    pending = pending_splits(x)
    fold = pending is not None and t <= FOLD_MAX_T and x.dtype == w.dtype and x.stride(-1) == w.stride(-1) == 1
    if pending is not None and not fold:
        take_splits(x)
    if t > SMALL_M or x.stride(-1) != 1 or w.stride(-1) != 1 or x.dtype != w.dtype:
        # cuBLAS writes the [T, H, N] rows in place (its C of head h: row stride H*N), so no copy follows the
        # product: bmm(...).transpose(0, 1).reshape copied every W_uv output, 4.3 GB a layer at a 128K prefill
        y = torch.empty(t, h, n, dtype=x.dtype, device=x.device)
        torch.bmm(x.transpose(0, 1), w, out=y.transpose(0, 1))
        return y.view(t, h * n) if flatten else y
    y = torch.empty(t, h * n, dtype=x.dtype, device=x.device)
    quant = flatten and n % FP8_BLOCK == 0 and x.dtype in (torch.bfloat16, torch.float16)
    fp8 = (torch.empty(t, h * n, dtype=torch.float8_e4m3fn, device=x.device),
           torch.empty(t, h * n // FP8_BLOCK, dtype=torch.float32, device=x.device)) if quant else (y, y)
    block_n = 128 if quant else 64
    part, lse = pending if fold else (x, x)
    if t:
        _head_gemm_kernel[(h, triton.cdiv(n, block_n))](
            x, w, y, *fp8, part, lse, t, k, n, part.shape[0] if fold else 1, x.stride(0), x.stride(1), w.stride(0),
            w.stride(1), *(part.stride()[:3] + lse.stride()[:2] if fold else (0,) * 5), QUANT=quant,
            FOLD=t if fold else 0, BLOCK_S=triton.next_power_of_2(part.shape[0]) if fold else 1,
            BLOCK_T=16 if t <= 16 else 32, BLOCK_N=block_n, BLOCK_K=64, PREFETCH=FOLD_PREFETCH, num_warps=4,
            num_stages=4, **pdl_args(x.device))
    if not flatten:
        return y.view(t, h, n)
    return attach_fp8(y, *fp8) if quant else y
