"""GPU fused MoE prefill: dense grouped FP8 GEMMs over expert-sorted rows (issue 17).

Owns: the large-batch path of `triton_moe.fused_moe` for FP8 experts (T*k >= PREFILL_MIN_PAIRS pairs). Given
`align_route`'s expert-sorted, BLOCK_M-padded pair order and its inverse pos, one call is
  1. permute + quantise (`_quant_scatter_kernel`): x[t] quantised per (row, 128) to e4m3 (quant_act_fp8's
     rule) once and stored as rows pos[t*k+j] of A1 (or `_permute_quant_kernel`: one program a row of A1).
     From here on every GEMM operand is a dense [rows, K] tile stream: no gathers, so TMA loads them;
  2. GEMM1 (`_grouped_fp8_gemm_kernel`, GATED): A1 @ w13[e]^T, gate and up tiles at once, SiLU(gate)*up
     rounded to bf16 and quantised per (row, 128) in the epilogue -> act e4m3 + scales, in the same order
     (BLOCK_N 128 = one quant group; other BLOCK_N write bf16 and `quant_act_fp8` runs after);
  3. GEMM2: act @ w2[e]^T -> out bf16 [rows, H], same order, unweighted;
  4. un-permute + combine (`_unpermute_combine_kernel`): y[t] = sum_j w[t,j] * out[pos[t*k+j]] in fp32,
     rounded once (+ add); an absent expert's pair has pos -1 and adds nothing.
Activation scales are stored K-major ([K/128, rows]) so a K step loads its BLOCK_M scales contiguously;
both block scales multiply each K step's partial product. Tiles are walked in GROUP_M-row bands (the
weights of one expert stay in L2 while its M blocks pass), by one program per tile or a persistent grid.
`PREFILL_CONFIG` is the default tiling (flip it after a sweep: bench/sweep_moe_prefill.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_fp8_gemm import FP8_BLOCK, num_sms, quant_act_fp8, quant_rows_fp8
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

try:  # host-side TMA descriptors (Triton >= 3.4; the H200 has 3.6)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

# Default of the prefill path; every key may be overridden per call (`fused_moe(config=...)`).
# kernel: what fused_moe runs for FP8 experts from PREFILL_MIN_PAIRS pairs ("dense": this module; "gemm":
#   triton_moe's gather kernel, 534 TFLOP/s at T=4096 on the H200);
# block_m: rows per expert block (moe_align's padding); bn1 / warps1 / stages1: GEMM1 (gate and up tiles, so
#   the MMA tile is block_m x 2*bn1); bn2 / warps2 / stages2: GEMM2; group_m: M blocks per band;
# persistent: one program per SM looping over tiles; tma: TMA descriptor loads (else pointer loads of the
#   same dense rows); mma_acc: the MMA accumulates in place, block scales as a per-row rescale (`_k_step`);
#   permute: "token" (each token quantised once, copied to its k rows) or "slot" (`permute_quant`);
#   flatten (persistent only) / pair_n (GEMM2): `_grouped_fp8_gemm_kernel`'s FLATTEN / PAIR_N.
#   lag: `_k_step`'s LAG (promotion one K step behind the MMA).
#   persistent, flatten, mma_acc, pair_n, lag: both GEMMs, unless "<key>1" / "<key>2" sets one GEMM's.
# H200 sweep (2026-12-01, bench/RESULTS.md): mma_acc False (fp32 adds every 128 K, DeepGEMM's promotion) was
#   the fastest correct variant at T = 4096 / 8192 / 16384 tokens, uniform and skewed routing: 605-671 TFLOP/s,
#   0.42-0.47 of that run's _scaled_mm FP8 peak (the gather kernel 470-511, 0.33-0.36), same error as the
#   reference's other paths (rel 0.0434 vs 0.0436).
# gemm: "triton" (this module's grouped GEMM), "cublas" (`cublas_moe_prefill`: a block-scaled _scaled_mm an
#   expert, sizes read on the host) or "auto": cublas where it may run (CUDA sm_90, cuBLAS's shapes, no graph
#   capture) and the experts average at least cublas_min_rows rows. H200, 2026-12-03 (bench/RESULTS.md,
#   seventeenth session; slice shapes): cublas 0.63-0.68 of the FP8 peak at 2K-4K rows an expert (T = 8192 /
#   16384) against this module's 0.52-0.54; at 1K rows 0.56 against 0.49-0.52 on one machine but slower skewed
#   on another, whose host took ~45 us a _scaled_mm (16 us on the first): 2048 keeps the host out of the way.
PREFILL_CONFIG = {"kernel": "dense", "block_m": 128, "bn1": 128, "warps1": 8, "stages1": 3,
                  "bn2": 128, "warps2": 8, "stages2": 4, "group_m": 8, "persistent": False, "tma": True,
                  "mma_acc": False, "permute": "token", "flatten": False, "pair_n": False,
                  "lag": False, "gemm": "auto", "cublas_min_rows": 2048}
PERMUTE_GROUPS = 8  # 128-groups a permute program quantises (6 programs a GLM-5.3 row)


@triton.jit
def _permute_quant_kernel(x_ptr, q_ptr, s_ptr, pos_ptr, sorted_ptr, total_ptr, num_pairs, K, stride_xm, rows_pad,
                          TOP_K: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Row `slot` of the sorted A1: x[pair // k] quantised per 128-group (padding slots -> zeros)."""
    grid_dependency_sync(PDL)
    slot = tl.program_id(0)
    if slot >= tl.load(total_ptr):
        return
    pair = tl.load(sorted_ptr + slot)
    valid = pair < num_pairs
    row = (pair // TOP_K).to(tl.int64)
    offs_g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    kmask = offs_k < K
    x = tl.load(x_ptr + row * stride_xm + offs_k, mask=kmask & valid, other=0.0).to(tl.float32)
    q, scale = quant_rows_fp8(x)  # quant_act_fp8's rule
    s64 = slot.to(tl.int64)
    tl.store(q_ptr + s64 * K + offs_k, q, mask=kmask)
    tl.store(s_ptr + offs_g.to(tl.int64) * rows_pad + s64, scale, mask=offs_g * GROUP < K)
    if (tl.program_id(1) == 0) & valid:
        tl.store(pos_ptr + pair, slot)


@triton.jit
def quantised_token(x_ptr, stride_xm, K, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr):
    """The program's token t = program 0 and its groups (program 1), quantised by quant_act_fp8's rule: (t, offs_g,
    offs_k, kmask, gmask, q [GROUPS_PER_PROG, GROUP] e4m3, scale [GROUPS_PER_PROG]). Both token scatters start so."""
    t = tl.program_id(0).to(tl.int64)
    offs_g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    kmask = offs_k < K
    x = tl.load(x_ptr + t * stride_xm + offs_k, mask=kmask, other=0.0).to(tl.float32)
    q, scale = quant_rows_fp8(x)
    return t, offs_g, offs_k, kmask, offs_g * GROUP < K, q, scale


@triton.jit
def _quant_scatter_kernel(x_ptr, q_ptr, s_ptr, pos_ptr, K, stride_xm, rows_pad, TOP_K: tl.constexpr,
                          GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, PDL: tl.constexpr = False):
    """x[t] quantised per 128-group once and stored to the row pos[t*k+j] of each of its k pairs (pos -1, an
    absent expert's pair: nowhere). Reads x once where the slot-driven kernel reads it k times."""
    grid_dependency_sync(PDL)
    t, offs_g, offs_k, kmask, gmask, q, scale = quantised_token(x_ptr, stride_xm, K, GROUP, GROUPS_PER_PROG)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + t * TOP_K + j)
        p64 = tl.maximum(p, 0).to(tl.int64)
        tl.store(q_ptr + p64 * K + offs_k, q, mask=kmask & (p >= 0))
        tl.store(s_ptr + offs_g.to(tl.int64) * rows_pad + p64, scale, mask=gmask & (p >= 0))


@triton.jit
def _load_rows(src, row0, k0, offs_r, offs_k, R, K, stride, USE_TMA: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """A [BLOCK_R, BLOCK_K] tile of a row-major 2-D operand from row0, k0 (a TMA descriptor or a pointer)."""
    if USE_TMA:
        tile = src.load([row0, k0])
    else:
        rows = (row0 + offs_r).to(tl.int64)
        ks = k0 + offs_k
        tile = tl.load(src + rows[:, None] * stride + ks[None, :], mask=(rows[:, None] < R) & (ks[None, :] < K),
                       other=0.0)
    return tile


@triton.jit
def _k_step(acc, unit, prev, a, w, sa, ws_ptrs, ws_ptr0, nmask, ONE_WS: tl.constexpr, MMA_ACC: tl.constexpr,
            LAG: tl.constexpr):
    """acc += (a @ w^T) * sa[row] * ws[col] for one 128-deep K step; returns (acc, unit, prev).

    MMA_ACC (needs ONE_WS): acc is kept in units of the last step's scales (true sum = acc * unit[row]), so
    the MMA accumulates into it in place: acc = a @ w^T + acc * (unit / s), unit = s. No second
    [BM, BN] fp32 tile for the step's product (registers), one multiply an element as before. fp32 holds
    the range: s >= 2e-15 * the smallest weight scale. But the whole K sum then runs through the FP8 MMA's
    accumulator, which on sm_90 adds with reduced precision (Triton's default there: no promotion), where
    the other mode promotes every 128 K as DeepGEMM does: the sweep reports both modes' errors.
    LAG (needs ONE_WS): the step's product is kept (prev, its scales in unit) and added one step later, so
    this step's MMA is issued before the last one's promotion and may run under it (one more [BM, BN] tile
    live; the caller adds the last prev after the loop).
    Else: the step's product is scaled and added in fp32."""
    if LAG:
        part = tl.dot(a, tl.trans(w))
        acc += prev * unit[:, None]
        prev = part
        unit = sa * tl.load(ws_ptr0)
    elif MMA_ACC:
        s = sa * tl.load(ws_ptr0)
        acc = tl.dot(a, tl.trans(w), acc * (unit / s)[:, None])
        unit = s
    elif ONE_WS:  # a [BM] vector times a scalar, then one multiply an element
        acc += tl.dot(a, tl.trans(w)) * (sa * tl.load(ws_ptr0))[:, None]
    else:
        acc += tl.dot(a, tl.trans(w)) * (sa[:, None] * tl.load(ws_ptrs, mask=nmask, other=0.0)[None, :])
    return acc, unit, prev


@triton.jit
def _grouped_fp8_gemm_kernel(a_src, as_ptr, b_src, bs_ptr, c_ptr, cs_ptr, bexp_ptr, total_ptr,
                             N, K, rows_pad, b_rows, b_total, up_offset, stride_bse, stride_bsn, stride_bsk, stride_cm,
                             GATED: tl.constexpr, QUANT_OUT: tl.constexpr, USE_TMA: tl.constexpr,
                             ONE_WS: tl.constexpr, MMA_ACC: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                             PAIR_N: tl.constexpr = False, FLATTEN: tl.constexpr = False, LAG: tl.constexpr = False,
                             PDL: tl.constexpr = False):
    """C[rows of block m, n] = sum_k A[row, k] * W_e[n, k] * sa[k/128, row] * sw_e[n/128, k/128], e = bexp[m].

    A: [rows_pad, K] e4m3 (dense, expert-sorted), its scales K-major at as_ptr; W: every expert's rows stacked
    [E * b_rows, K] e4m3 with block scales [E, b_rows/128, K/128]. GATED: W_e rows n (gate) and
    up_offset + n (up), C = silu(gate) * up. QUANT_OUT (BLOCK_N == 128): C rounded to bf16, then stored as
    e4m3 with its per-(row, 128) scale K-major at cs_ptr; else C in c_ptr's dtype. ONE_WS: a tile's columns
    (gate and up) lie in one weight scale block, so the weight scale is one scalar a K step; MMA_ACC: see
    `_k_step`, as LAG. PAIR_N (not GATED): a tile is 2 x BLOCK_N columns, kept as GATED's two accumulators (the
    second at up_offset = BLOCK_N), so each still lies in one weight scale block (ONE_WS). FLATTEN
    (persistent grids): the tile and K loops flattened into one software pipeline, so the next tile's loads
    are in flight during this tile's epilogue. (Triton 3.6's `warp_specialize` leaves this loop's sm_90 code
    unchanged: not offered.)
    """
    grid_dependency_sync(PDL)
    num_m = tl.load(total_ptr) // BLOCK_M
    num_n = tl.cdiv(N, 2 * BLOCK_N if PAIR_N else BLOCK_N)
    band = GROUP_M * num_n
    offs_r = tl.arange(0, BLOCK_M)
    offs_c = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=FLATTEN):
        first_m = (tile // band) * GROUP_M
        rows_in_band = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (tile % band) % rows_in_band
        pid_n = (tile % band) // rows_in_band
        e = tl.load(bexp_ptr + pid_m)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * (2 * BLOCK_N if PAIR_N else BLOCK_N)
        offs_n = n0 + offs_c
        nmask = offs_n < N
        umask = offs_n + up_offset < N if PAIR_N else nmask
        offs_m = (m0 + offs_r).to(tl.int64)
        bs_g = bs_ptr + e.to(tl.int64) * stride_bse + (offs_n // 128) * stride_bsn
        bs_u = bs_ptr + e.to(tl.int64) * stride_bse + ((offs_n + up_offset) // 128) * stride_bsn
        bs_g0 = bs_ptr + e.to(tl.int64) * stride_bse + (n0 // 128) * stride_bsn
        bs_u0 = bs_ptr + e.to(tl.int64) * stride_bse + ((n0 + up_offset) // 128) * stride_bsn
        brow = e * b_rows + n0
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        unit_g = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        unit_u = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
        prev_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # LAG only: the step not yet added
        prev_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range(0, tl.cdiv(K, BLOCK_K)):
            k0 = kb * BLOCK_K
            a = _load_rows(a_src, m0, k0, offs_r, offs_k, rows_pad, K, K, USE_TMA, BLOCK_M, BLOCK_K)
            sa = tl.load(as_ptr + offs_m + kb * rows_pad)  # < 2^31: the scale count of A
            w = _load_rows(b_src, brow, k0, offs_c, offs_k, b_total, K, K, USE_TMA, BLOCK_N, BLOCK_K)
            acc_g, unit_g, prev_g = _k_step(acc_g, unit_g, prev_g, a, w, sa, bs_g + kb * stride_bsk,
                                            bs_g0 + kb * stride_bsk, nmask, ONE_WS, MMA_ACC, LAG)
            if GATED or PAIR_N:
                w = _load_rows(b_src, brow + up_offset, k0, offs_c, offs_k, b_total, K, K, USE_TMA, BLOCK_N,
                               BLOCK_K)
                acc_u, unit_u, prev_u = _k_step(acc_u, unit_u, prev_u, a, w, sa, bs_u + kb * stride_bsk,
                                                bs_u0 + kb * stride_bsk, umask, ONE_WS, MMA_ACC, LAG)
        if LAG:
            acc_g += prev_g * unit_g[:, None]
            acc_u += prev_u * unit_u[:, None]
        if MMA_ACC:
            acc_g = acc_g * unit_g[:, None]
            acc_u = acc_u * unit_u[:, None]
        if GATED:
            acc_g = acc_g * tl.sigmoid(acc_g) * acc_u
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
        if QUANT_OUT:  # quant_act_fp8 of the bf16 act: the same bytes the unfused path would produce
            h = tl.where(nmask[None, :], acc_g.to(tl.bfloat16).to(tl.float32), 0.0)
            q, scale = quant_rows_fp8(h)
            tl.store(c_ptrs, q, mask=nmask[None, :])
            tl.store(cs_ptr + pid_n.to(tl.int64) * rows_pad + offs_m, scale)
        else:
            tl.store(c_ptrs, acc_g.to(c_ptr.dtype.element_ty), mask=nmask[None, :])
            if PAIR_N:
                tl.store(c_ptrs + up_offset, acc_u.to(c_ptr.dtype.element_ty), mask=umask[None, :])


@triton.jit
def _store_combined(acc, y_ptr, add_ptr, t, H, offs, mask, HAS_ADD: tl.constexpr):
    """y[t, offs] = the fp32 sum `acc` rounded once to y's dtype, then (HAS_ADD) + add[t, offs] rounded again, as
    the reference's sum(1, dtype=fp32).to(dtype) + add does: both MoE combine kernels end here."""
    y = acc.to(y_ptr.dtype.element_ty)
    if HAS_ADD:
        y = (y.to(tl.float32) + tl.load(add_ptr + t * H + offs, mask=mask, other=0.0).to(tl.float32))
        y = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * H + offs, y, mask=mask)


@triton.jit
def _unpermute_combine_kernel(x_ptr, pos_ptr, tw_ptr, y_ptr, add_ptr, H, stride_x, TOP_K: tl.constexpr,
                              BLOCK: tl.constexpr, HAS_ADD: tl.constexpr, PDL: tl.constexpr = False):
    """y[t] = sum_j tw[t*k+j] * x[pos[t*k+j]] in fp32, rounded once (+ add[t], rounded again as torch's add);
    pos -1 (an absent expert's pair) adds nothing."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + t * TOP_K + j)
        w = tl.load(tw_ptr + t * TOP_K + j)
        v = tl.load(x_ptr + tl.maximum(p, 0).to(tl.int64) * stride_x + offs, mask=mask & (p >= 0), other=0.0)
        acc += v.to(tl.float32) * w
    _store_combined(acc, y_ptr, add_ptr, t, H, offs, mask, HAS_ADD)


def _key(cfg: dict, key: str, gemm: int):
    """cfg's value of `key` for GEMM `gemm` (1 or 2): "<key><gemm>" where given, else "<key>"."""
    return cfg.get(f"{key}{gemm}", cfg.get(key))


def _operand(t: torch.Tensor, rows: int, block_rows: int, tma: bool):
    """A 2-D [rows, K] operand as the GEMM kernel takes it: a TMA descriptor of [block_rows, 128] tiles, or
    the tensor itself (pointer loads)."""
    t2 = t.reshape(rows, t.shape[-1])
    return TensorDescriptor.from_tensor(t2, [block_rows, FP8_BLOCK]) if tma else t2


def gemm_plan(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, out: torch.Tensor,
              out_s: torch.Tensor | None, route: tuple, n: int, gated: bool, cfg: dict,
              gemm: int) -> tuple[int, tuple, dict]:
    """(grid size, arguments, meta-parameters) of one `_grouped_fp8_gemm_kernel` launch (see `grouped_gemm`)."""
    bexp, total = route[1], route[2]
    bm, bn = cfg["block_m"], cfg[f"bn{gemm}"]
    rows_pad, k = a.shape
    e, b_rows = w.shape[0], w.shape[1]
    tma = bool(cfg["tma"]) and TensorDescriptor is not None
    pair = not gated and bool(_key(cfg, "pair_n", gemm))
    tiles = bexp.numel() * triton.cdiv(n, 2 * bn if pair else bn)
    persistent = bool(_key(cfg, "persistent", gemm))
    grid = min(tiles, num_sms(a.device.index if a.is_cuda else None)) if persistent else tiles
    args = (_operand(a, rows_pad, bm, tma), a_s, _operand(w.contiguous(), e * b_rows, bn, tma), w_s, out,
            out if out_s is None else out_s, bexp, total, n, k, rows_pad, b_rows, e * b_rows,
            n if gated else (bn if pair else 0),
            w_s.stride(0), w_s.stride(1), w_s.stride(2), out.stride(0))
    one_ws = FP8_BLOCK % bn == 0 and (not gated or n % FP8_BLOCK == 0)  # up rows start on a scale block
    meta = dict(GATED=gated, QUANT_OUT=out_s is not None, USE_TMA=tma, ONE_WS=one_ws,
                MMA_ACC=bool(_key(cfg, "mma_acc", gemm)) and one_ws, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=FP8_BLOCK,
                LAG=bool(_key(cfg, "lag", gemm)) and one_ws and not _key(cfg, "mma_acc", gemm),
                GROUP_M=cfg["group_m"], PAIR_N=pair, FLATTEN=persistent and bool(_key(cfg, "flatten", gemm)),
                num_warps=cfg[f"warps{gemm}"], num_stages=cfg[f"stages{gemm}"])
    return grid, args, meta


def grouped_gemm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, out: torch.Tensor,
                 out_s: torch.Tensor | None, route: tuple, n: int, gated: bool, cfg: dict, gemm: int) -> None:
    """out[rows] = (a @ w[e]^T per expert block) through `_grouped_fp8_gemm_kernel`.

    a [rows_pad, K] e4m3, a_s K-major [K/128, rows_pad]; w [E, b_rows, K] e4m3, w_s [E, b_rows/128, K/128];
    out_s given: out is e4m3 and takes GEMM1's quantised act (block_n must be 128). gemm: 1 or 2 (config keys).
    """
    if out_s is not None and cfg[f"bn{gemm}"] != FP8_BLOCK:
        raise ValueError(f"grouped_gemm: a quantised output needs block_n {FP8_BLOCK}, got {cfg[f'bn{gemm}']}")
    grid, args, meta = gemm_plan(a, a_s, w, w_s, out, out_s, route, n, gated, cfg, gemm)
    if grid:
        _grouped_fp8_gemm_kernel[(grid,)](*args, **meta, **pdl_args(a.device))


def groups_per_prog(k: int) -> int:
    """128-groups a row-quantising program takes for rows of k (at most PERMUTE_GROUPS, a power of two)."""
    return min(PERMUTE_GROUPS, triton.next_power_of_2(triton.cdiv(k, FP8_BLOCK)))


def permute_quant(x: torch.Tensor, route: tuple, top_k: int,
                  mode: str = "token") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A1 e4m3 [rows_pad, H], its scales K-major [H/128, rows_pad], pos [T*k] int32: a pair's row, or -1).

    route: `align_route`'s (sorted_ids, block_expert, total, pos, ends), or `moe_align`'s three (mode "slot" only).
    mode "token" (`_quant_scatter_kernel`): each token read and quantised once, its fp8 row stored to its k
    slots; padding rows are left unwritten (rows are independent through both GEMMs and the combine never
    reads them). "slot" (`_permute_quant_kernel`): one program a slot, x read k times, padding rows zeros.
    """
    sorted_ids, rows_pad, (t, h) = route[0], route[0].numel(), x.shape
    kg = triton.cdiv(h, FP8_BLOCK)
    q = torch.empty(rows_pad, h, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(kg, rows_pad, dtype=torch.float32, device=x.device)
    gpp = groups_per_prog(h)
    if mode == "token":
        pos = route[3]
        if t:
            _quant_scatter_kernel[(t, triton.cdiv(kg, gpp))](
                x, q, s, pos, h, x.stride(0), rows_pad, TOP_K=top_k, GROUP=FP8_BLOCK, GROUPS_PER_PROG=gpp,
                **pdl_args(x.device))
        return q, s, pos
    if mode != "slot":
        raise ValueError(f"permute_quant: mode is 'token' or 'slot', got {mode!r}")
    pos = torch.full((t * top_k,), -1, dtype=torch.int32, device=x.device)
    _permute_quant_kernel[(rows_pad, triton.cdiv(kg, gpp))](
        x, q, s, pos, sorted_ids, route[2], t * top_k, h, x.stride(0), rows_pad, TOP_K=top_k, GROUP=FP8_BLOCK,
        GROUPS_PER_PROG=gpp, **pdl_args(x.device))
    return q, s, pos


def moe_prefill_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                    w2_scale: torch.Tensor, topk_weights: torch.Tensor, route: tuple, top_k: int,
                    add: torch.Tensor | None, cfg: dict) -> torch.Tensor:
    """`fused_moe` for FP8 experts over `align_route(ids, E, cfg["block_m"])`'s route: x [T, H] -> [T, H]."""
    t, h = x.shape
    inter = w13.shape[1] // 2
    rows_pad = route[0].numel()
    a1, a1_s, pos = permute_quant(x, route, top_k, cfg["permute"])
    act_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    if cfg["bn1"] == FP8_BLOCK:  # the epilogue quantises: act never exists in bf16
        act = torch.empty(rows_pad, inter, dtype=torch.float8_e4m3fn, device=x.device)
        act_s = torch.empty(triton.cdiv(inter, FP8_BLOCK), rows_pad, dtype=torch.float32, device=x.device)
        grouped_gemm(a1, a1_s, w13, w13_scale, act, act_s, route, inter, True, cfg, 1)
    else:
        act16 = torch.empty(rows_pad, inter, dtype=act_dtype, device=x.device)
        grouped_gemm(a1, a1_s, w13, w13_scale, act16, None, route, inter, True, cfg, 1)
        act, act_s = quant_act_fp8(act16, scale_m_major=True)
        act_s = act_s.t()  # K-major storage [I/128, rows_pad]
        del act16
    del a1, a1_s  # freed once read: out below is the largest buffer (a 128K-token chunk's are GBs)
    out = torch.empty(rows_pad, h, dtype=act_dtype, device=x.device)
    grouped_gemm(act, act_s, w2, w2_scale, out, None, route, h, False, cfg, 2)
    return unpermute_combine(out, pos, topk_weights, add, x.dtype)


def unpermute_combine(out: torch.Tensor, pos: torch.Tensor, topk_weights: torch.Tensor, add: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """y [T, H] in dtype: y[t] = sum_j w[t, j] * out[pos[t*k+j]] (+ add[t]) (`_unpermute_combine_kernel`)."""
    (t, top_k), h = topk_weights.shape, out.shape[1]
    y = torch.empty(t, h, dtype=dtype, device=out.device)
    if t:
        block = min(triton.next_power_of_2(h), 1024)
        add = add.contiguous() if add is not None else None
        _unpermute_combine_kernel[(t, triton.cdiv(h, block))](
            out, pos, topk_weights.reshape(-1).float().contiguous(), y, y if add is None else add, h,
            out.stride(0), TOP_K=top_k, BLOCK=block, HAS_ADD=add is not None, **pdl_args(out.device))
    return y
