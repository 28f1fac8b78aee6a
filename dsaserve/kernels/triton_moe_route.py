"""GPU MoE routing: the router GEMV and `moe_route`, one launch each (request path stage 6, MoE layers);
the same GEMV serves `small_linear` (the indexer's weights_proj).

Owns: the GPU variant of `reference.router_logits` (decode sizes: fp32 dot products in one launch, where
x.float() + cuBLAS's GEMV were three per layer; 33-256 tokens: split-K tiles on tensor cores, exact bf16 products
of the router's weight as the checkpoint stores it, summed in fp32) and of `reference.moe_route`: sigmoid
scores, the correction bias steering selection only, group-limited top-k (a group's score is the sum of its two
best biased scores), the chosen scores normalised and scaled. One program per token holds all E experts in
registers. As torch ops the same math was ~15 launches per MoE layer (~35 µs at batch 1 even inside a CUDA
graph, bench/RESULTS.md).
Ties pick the lower expert index; torch.topk leaves tie order unspecified, so only exact ties can differ.
Imported only by `kernels/registry.py` after it checked that Triton and a CUDA device are there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_fp8_gemm import even_split, num_sms
from dsaserve.kernels.triton_utils import TensorNote, grid_dependency_sync, pdl_args


@triton.jit
def _weight_rows(w_ptr, offs_e, emask, offs_k, kmask, stride_w):
    """Rows offs_e, columns offs_k of the router / weights_proj weight, in fp32."""
    return tl.load(w_ptr + offs_e[:, None] * stride_w + offs_k[None, :], mask=emask[:, None] & kmask[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, K, E, stride_x, stride_w, stride_o, BLOCK_E: tl.constexpr,
                          BLOCK_K: tl.constexpr, WEIGHT_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    """out[t, e] = sum_k float(x[t, k]) * float(w[e, k]) in fp32, stored in out's dtype; program (t, block of
    BLOCK_E rows of w). WEIGHT_FIRST (K <= BLOCK_K: one block): the weight rows read before the PDL wait."""
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = offs_e < E
    if WEIGHT_FIRST:
        offs_k = tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        w = _weight_rows(w_ptr, offs_e, emask, offs_k, kmask, stride_w)
        grid_dependency_sync(PDL)
        t = tl.program_id(0).to(tl.int64)
        x = tl.load(x_ptr + t * stride_x + offs_k, mask=kmask, other=0.0).to(tl.float32)
        acc = w * x[None, :]
    else:
        grid_dependency_sync(PDL)
        t = tl.program_id(0).to(tl.int64)
        acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            x = tl.load(x_ptr + t * stride_x + offs_k, mask=kmask, other=0.0).to(tl.float32)
            acc += _weight_rows(w_ptr, offs_e, emask, offs_k, kmask, stride_w) * x[None, :]
    tl.store(out_ptr + t * stride_o + offs_e, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=emask)


ROUTER_GEMV_MAX_T = 32  # tokens up to which the Triton GEMV runs; larger batches are a real GEMM (cuBLAS)
# The router GEMV's weight rows (where one block holds K) and moe_route's correction bias read before the PDL wait:
# no kernel writes them, and at batch 1 each comes from HBM after the wait, behind a one-program norm (for the
# router) or beside the logits' L2 read. Off until a GPU has run it (written in the sixtieth session, when none
# came; RMSNorm's weight read so took 9-10 µs off an H100's b1 step): bench/profile_decode.py's "route_weights_first"
WEIGHTS_FIRST = False


def _row_gemv(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """x [T, K] @ weight [E, K]^T in fp32 -> [T, E] out_dtype in one launch, or None where it does not apply
    (more than ROUTER_GEMV_MAX_T rows, strided rows)."""
    t, k = x.shape
    e = weight.shape[0]
    if t > ROUTER_GEMV_MAX_T or x.stride(-1) != 1 or weight.stride(-1) != 1:
        return None
    out = torch.empty(t, e, dtype=out_dtype, device=x.device)
    # one weight row per program, loaded whole (GLM-5.3: 6144 fp32 = 24 KB in one go): the H200 measured
    # 6.8 us per layer at batch 1 for 2 rows per program in 4 KB steps, each load waiting on the last
    block_k = min(triton.next_power_of_2(k), 8192)
    if t:
        _router_logits_kernel[(t, e)](x, weight, out, k, e, x.stride(0), weight.stride(0), out.stride(0),
                                      BLOCK_E=1, BLOCK_K=block_k, WEIGHT_FIRST=WEIGHTS_FIRST and k <= block_k,
                                      num_warps=8, **pdl_args(x.device))
    return out


@triton.jit
def _tile_partial_kernel(x_ptr, w_ptr, part_ptr, T, E, k_per_split, stride_x, stride_w, BLOCK_T: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """part[s, t, e] = sum over split s's K range of x[t, k] * w[e, k]: 16-bit operands (w as stored, or fp32
    holding 16-bit values, cast exactly) on tensor cores, fp32 sums; program (token block, expert block, split)."""
    grid_dependency_sync(PDL)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(2)
    offs_k = split * k_per_split + tl.arange(0, BLOCK_K)
    tmask, emask = offs_t < T, offs_e < E
    x_ptrs = x_ptr + offs_t[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = w_ptr + offs_e[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=tmask[:, None], other=0.0)
        w = tl.load(w_ptrs + k0, mask=emask[:, None], other=0.0).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc)
    tl.store(part_ptr + (split * T + offs_t[:, None]) * E + offs_e[None, :], acc, mask=tmask[:, None] & emask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, n, splits, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
    """out.flat[i] = the sum of part[s].flat[i] over the splits (one load of them all, a fixed tree order), in
    out's dtype (one rounding)."""
    grid_dependency_sync(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.arange(0, BLOCK_S)
    tile = tl.load(part_ptr + s[:, None] * n + offs[None, :], mask=(s[:, None] < splits) & (offs[None, :] < n),
                   other=0.0)
    tl.store(out_ptr + offs, tl.sum(tile, axis=0).to(out_ptr.dtype.element_ty), mask=offs < n)


TILE_GEMM_MAX_T = 256  # tokens up to which the tiled kernels run past the GEMV (batch-128 decode: cuBLAS's sgemm,
# or a split-K GEMM and its reduce, plus x.float(): 9-11 us a layer, bench/RESULTS.md twenty-fourth session)
_SIXTEEN_BIT = TensorNote("_dsaserve_sixteen_bit")  # on an fp32 weight: whether bf16 holds it exactly


def _holds_bf16(weight: torch.Tensor) -> bool:
    """An fp32 weight whose values are all bf16 (the router's: widened from the checkpoint's bf16), checked once
    per weight outside a CUDA-graph capture (a sync); inside one an unchecked weight counts as not."""
    if weight.dtype != torch.float32:
        return False
    known = _SIXTEEN_BIT.get(weight)
    if known is None:
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        known = (bool(torch.equal(weight.to(torch.bfloat16).float(), weight)),)
        _SIXTEEN_BIT.attach(weight, known)
    return known[0]


def _tile_gemm(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """x [T, K] @ weight [E, K]^T -> [T, E] out_dtype for ROUTER_GEMV_MAX_T < T <= TILE_GEMM_MAX_T: split K over
    about one program an SM, the splits' fp32 partials summed in a fixed order by a second launch. x in bf16 / fp16 and
    the weight in x's dtype, or fp32 holding bf16 values with a bf16 x; else None."""
    t, k = x.shape
    e = weight.shape[0]
    # the weight's check comes before the row-count test on purpose: any eager call past ROUTER_GEMV_MAX_T rows (a
    # warm-up, the memory profile) settles it, so a CUDA-graph capture of 33-256 rows finds it known
    sixteen = x.dtype in (torch.bfloat16, torch.float16) and (
        weight.dtype == x.dtype or (x.dtype == torch.bfloat16 and _holds_bf16(weight)))
    if not ROUTER_GEMV_MAX_T < t <= TILE_GEMM_MAX_T or not sixteen or k % 64 or x.stride(-1) != 1 or \
            weight.stride(-1) != 1:
        return None
    block_t, block_e = 64, min(64, max(16, triton.next_power_of_2(e)))
    tiles = triton.cdiv(t, block_t) * triton.cdiv(e, block_e)
    blocks = k // 64
    splits = even_split(blocks, min(32, num_sms(x.device.index if x.is_cuda else None) // tiles))
    part = torch.empty(splits, t, e, dtype=torch.float32, device=x.device)
    _tile_partial_kernel[(triton.cdiv(t, block_t), triton.cdiv(e, block_e), splits)](
        x, weight, part, t, e, k // splits, x.stride(0), weight.stride(0), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=64, num_warps=4, num_stages=3, **pdl_args(x.device))
    out = torch.empty(t, e, dtype=out_dtype, device=x.device)
    _sum_splits_kernel[(triton.cdiv(t * e, 64),)](part, out, t * e, splits, BLOCK_S=triton.next_power_of_2(splits),
                                                 BLOCK=64, num_warps=4, **pdl_args(x.device))
    return out


def router_logits(x: torch.Tensor, weight_f32: torch.Tensor) -> torch.Tensor:
    """GPU `reference.router_logits`: x [T, H] (any float dtype) @ weight_f32 [E, H]^T -> [T, E] fp32."""
    out = _row_gemv(x, weight_f32, torch.float32) if weight_f32.dtype == torch.float32 else None
    if out is None:
        out = _tile_gemm(x, weight_f32, torch.float32)
    return torch.nn.functional.linear(x.float(), weight_f32.float()) if out is None else out


SMALL_LINEAR_MAX_ROWS = 256  # weights with more output rows (a dequantised TP shard) keep cuBLAS


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """GPU `reference.small_linear`. A dense projection with few output rows (the indexer's weights_proj,
    GLM-5.3 32 x 6144) at decode sizes: one Triton launch that joins the step's PDL chain, where cuBLAS ran a
    split-K GEMM and its reduce (two launches, 5.6 us a full layer at batch 1). Else cuBLAS."""
    few = x.dtype == weight.dtype and weight.dim() == 2 and weight.shape[0] <= SMALL_LINEAR_MAX_ROWS
    out = _row_gemv(x, weight, x.dtype) if few and x.dim() == 2 else None
    if out is None and few and x.dim() == 2:
        out = _tile_gemm(x, weight, x.dtype)
    return torch.nn.functional.linear(x, weight) if out is None else out


@triton.jit
def _moe_route_kernel(logit_ptr, bias_ptr, w_ptr, id_ptr, stride_l, scaling,
                      TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                      BIAS_FIRST: tl.constexpr = False, PDL: tl.constexpr = False):
    g = tl.arange(0, BLOCK_G)[:, None]
    j = tl.arange(0, BLOCK_E)[None, :]
    valid = (g < N_GROUP) & (j < GROUP)
    expert = g * GROUP + j  # [BLOCK_G, BLOCK_E]
    if BIAS_FIRST:  # no kernel writes it (`WEIGHTS_FIRST`)
        bias = tl.load(bias_ptr + expert, mask=valid, other=0.0)
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    logit = tl.load(logit_ptr + t * stride_l + expert, mask=valid, other=0.0).to(tl.float32)
    if not BIAS_FIRST:
        bias = tl.load(bias_ptr + expert, mask=valid, other=0.0)
    score = tl.sigmoid(logit)
    choice = tl.where(valid, score + bias, float("-inf"))
    if N_GROUP > 1:
        best = tl.max(choice, axis=1)
        if GROUP > 1:
            first = tl.argmax(choice, axis=1)
            best += tl.max(tl.where(j == first[:, None], float("-inf"), choice), axis=1)
        gsc = tl.where(tl.arange(0, BLOCK_G) < N_GROUP, best, float("-inf"))
        keep = tl.zeros([BLOCK_G], dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.arange(0, BLOCK_G) == tl.argmax(gsc, axis=0)
            keep = keep | pick
            gsc = tl.where(pick, float("-inf"), gsc)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    flat_choice = tl.reshape(choice, [BLOCK_G * BLOCK_E])
    flat_score = tl.reshape(score, [BLOCK_G * BLOCK_E])
    flat_expert = tl.reshape(expert, [BLOCK_G * BLOCK_E])
    slot = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        pick = tl.arange(0, BLOCK_G * BLOCK_E) == tl.argmax(flat_choice, axis=0)
        ids = tl.where(slot == k, tl.sum(tl.where(pick, flat_expert, 0), axis=0).to(tl.int64), ids)
        weights = tl.where(slot == k, tl.sum(tl.where(pick, flat_score, 0.0), axis=0), weights)
        flat_choice = tl.where(pick, float("-inf"), flat_choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    kmask = slot < TOP_K
    tl.store(w_ptr + t * TOP_K + slot, weights * scaling, mask=kmask)
    tl.store(id_ptr + t * TOP_K + slot, ids, mask=kmask)


def moe_route(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
              routed_scaling_factor: float, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPU `reference.moe_route`: logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64)."""
    t, e = router_logits.shape
    if e % n_group or not 0 < topk_group <= n_group or top_k > (e // n_group) * topk_group:
        raise ValueError(f"moe_route: {e} experts in {n_group} groups, {topk_group} groups kept, top-{top_k}: "
                         "not a valid routing")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    group = e // n_group
    if t:
        # an fp32 bias is the parameter itself (no copy kernel writes it just before), so it may be read early
        bias_first = WEIGHTS_FIRST and bias.dtype == torch.float32
        _moe_route_kernel[(t,)](logits, bias.float(), weights, ids, logits.stride(0), routed_scaling_factor,
                                TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group, GROUP=group,
                                BLOCK_G=triton.next_power_of_2(n_group), BLOCK_E=triton.next_power_of_2(group),
                                BLOCK_K=triton.next_power_of_2(top_k), NORM=norm_topk_prob, BIAS_FIRST=bias_first,
                                **pdl_args(logits.device))
    return weights, ids


@triton.jit
def _count_distinct_kernel(ids_ptr, n, num_values, counter_ptr, seen_ptr, E: tl.constexpr, CHUNK: tl.constexpr,
                           ONE_PROGRAM: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    e = tl.arange(0, E)
    hit = tl.zeros([E], dtype=tl.int32)
    first = tl.program_id(0) * CHUNK
    if ONE_PROGRAM:
        end = n
    else:
        end = tl.minimum(n, first + CHUNK)
    for c0 in range(first, end, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + offs, mask=offs < n, other=-1)
        hit = tl.maximum(hit, tl.max((ids[None, :] == e[:, None]).to(tl.int32), axis=1))
    hit = tl.where(e < num_values, hit, 0)  # an absent expert's id (num_values) is not a value
    if not ONE_PROGRAM:  # exactly one program finds each hit value's flag still 0
        old = tl.atomic_max(seen_ptr + e, hit, mask=hit > 0)
        hit = tl.where((hit > 0) & (old == 0), 1, 0)
    tl.atomic_add(counter_ptr, tl.sum(hit, axis=0).to(tl.int64))


ONE_PROGRAM_MAX_IDS = 4096  # decode and piecewise-graph steps: one program; a prefill's 65K ids took 0.9 ms so


def count_distinct(ids: torch.Tensor, num_values: int, counter: torch.Tensor) -> None:
    """GPU `reference.count_distinct`: counter (int64 scalar) += number of distinct values in ids (the
    `moe_experts_touched` counter, accumulated on the device inside CUDA graphs): one launch up to
    ONE_PROGRAM_MAX_IDS ids, else one program per 256 ids marking a zeroed flag per value."""
    flat = ids.contiguous().view(-1)
    n, width, chunk = flat.numel(), triton.next_power_of_2(num_values + 1), 256
    one = n <= ONE_PROGRAM_MAX_IDS
    seen = counter if one else torch.zeros(width, dtype=torch.int32, device=flat.device)
    _count_distinct_kernel[(1 if one else triton.cdiv(n, chunk),)](
        flat, n, num_values, counter, seen, E=width, CHUNK=chunk, ONE_PROGRAM=one, num_warps=8,
        **pdl_args(flat.device))
