"""GPU fused MoE prefill over cuBLAS: one block-scaled `torch._scaled_mm` per expert and GEMM (issue 17).

Owns: the large-prefill variant of `triton_moe_prefill.moe_prefill_fp8` (PREFILL_CONFIG["gemm"]). The Triton
grouped GEMM promotes its FP8 partial sums in registers every 128 K and reached 0.51-0.53 of the FP8 peak;
cuBLAS's block-scaled FP8 GEMM (the one every dense prefill projection already takes) runs near the peak at
a thousand rows, which is what an expert gets in a large prefill (8K tokens x top-8 / 32 experts = 2K rows).
cuBLAS takes its sizes on the host, so one call is:
  1. `align_route` (device) and the experts' run ends copied to pinned host memory without waiting;
  2. permute + quantise (`_quant_scatter_segments_kernel`): as `triton_moe_prefill`'s token scatter, but each
     expert's activation scales stored as its own [K/128, rows_e] block, the outer-dim-major layout that
     `_scaled_mm` takes for one expert's rows (its check: scale_a stride (1, M) with M = the call's rows);
  3. the host waits for the ends (the copy was queued before the permute, so the GPU has that kernel to run
     while the host waits and then issues the GEMMs), then per expert with rows: GEMM1 A_e @ w13[e]^T -> bf16
     gate|up rows written in place; SiLU(gate)*up rounded to bf16 and quantised per (row, 128) into the same
     per-expert scale blocks (`_silu_mul_quant_segments_kernel`); GEMM2 act_e @ w2[e]^T -> bf16 rows;
  4. `triton_moe_prefill.unpermute_combine`.
Not graph-capturable (host sizes): `fused_moe` takes the Triton grouped GEMM while a stream captures, and below
`cublas_min_rows` average rows an expert: each expert GEMM costs the host 16-45 us (`_scaled_mm` and its views,
by machine), which a GEMM of a few hundred rows does not cover. H200 (bench/RESULTS.md, seventeenth session):
GEMM1 993 and GEMM2 856 TFLOP/s at 2K rows an expert (DeepGEMM reports up to 1,550 on an H800), the whole MoE
0.63-0.68 of the FP8 peak from 8K tokens on (the Triton grouped GEMM's path: 0.52-0.54).
`scaled_mm` is the one cuBLAS entry point; the CPU tests swap in an emulation that checks the same layouts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_fp8_gemm import FP8_BLOCK, quant_rows_fp8, scaled_mm_ok, scaled_mm_shape_ok
from dsaserve.kernels.triton_moe_prefill import groups_per_prog, quantised_token, unpermute_combine
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

scaled_mm = torch._scaled_mm  # replaced by the CPU tests' emulation (tests/kernels/test_gpu_moe_prefill.py)
GEMM_CHOICES = ("auto", "triton", "cublas")  # PREFILL_CONFIG["gemm"]
SILU_ROWS_PER_PROG = 4  # rows a SiLU*up quantiser program takes (x 8 groups: a 32 x 128 tile)
_WEIGHT_VIEWS = "_dsaserve_expert_views"  # expert_weights' attribute on a w13 / w2 tensor


@triton.jit
def _segment(row, bexp_ptr, ends_ptr, BLOCK_M: tl.constexpr):
    """(first row, rows) of the expert run that holds `row` (runs are whole BLOCK_M blocks of one expert)."""
    e = tl.load(bexp_ptr + row // BLOCK_M)
    end = tl.load(ends_ptr + e)
    start = tl.where(e > 0, tl.load(ends_ptr + tl.maximum(e - 1, 0)), 0)
    return start.to(tl.int64), (end - start).to(tl.int64)


@triton.jit
def _quant_scatter_segments_kernel(x_ptr, q_ptr, s_ptr, pos_ptr, bexp_ptr, ends_ptr, K, stride_xm,
                                   TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
                                   GROUPS_PER_PROG: tl.constexpr, PDL: tl.constexpr = False):
    """x[t] quantised per 128-group once, stored to row p = pos[t*k+j] of each live pair; its scales at
    start_e * K/128 + group * rows_e + (p - start_e): expert e's [K/128, rows_e] block."""
    grid_dependency_sync(PDL)
    t, offs_g, offs_k, kmask, gmask, q, scale = quantised_token(x_ptr, stride_xm, K, GROUP, GROUPS_PER_PROG)
    kg = tl.cdiv(K, GROUP)
    for j in tl.static_range(TOP_K):
        p = tl.load(pos_ptr + t * TOP_K + j)
        p64 = tl.maximum(p, 0).to(tl.int64)
        start, rows = _segment(p64, bexp_ptr, ends_ptr, BLOCK_M)
        tl.store(q_ptr + p64 * K + offs_k, q, mask=kmask & (p >= 0))
        tl.store(s_ptr + start * kg + offs_g * rows + (p64 - start), scale, mask=gmask & (p >= 0))


@triton.jit
def _silu_mul_quant_segments_kernel(h_ptr, q_ptr, s_ptr, bexp_ptr, ends_ptr, total_ptr, inter, stride_h,
                                    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
                                    ROWS_PER_PROG: tl.constexpr, PDL: tl.constexpr = False):
    """act[r] = SiLU(h[r, :inter]) * h[r, inter:] in fp32, rounded to bf16 (the fused GEMM1 epilogue's rule),
    quantised per 128-group into row r of q and the per-expert scale blocks; rows at or past the total: nothing.
    One (row, group) a row of the program's tile, as `quant_act_fp8`'s kernel (tiny programs cost 4x)."""
    grid_dependency_sync(PDL)
    rg = tl.arange(0, ROWS_PER_PROG * GROUPS_PER_PROG)
    r = tl.program_id(0).to(tl.int64) * ROWS_PER_PROG + rg // GROUPS_PER_PROG
    live = r < tl.load(total_ptr)
    offs_g = tl.program_id(1) * GROUPS_PER_PROG + rg % GROUPS_PER_PROG
    offs_i = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    imask = (offs_i < inter) & live[:, None]
    gate = tl.load(h_ptr + r[:, None] * stride_h + offs_i, mask=imask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + r[:, None] * stride_h + inter + offs_i, mask=imask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate) * up).to(tl.bfloat16).to(tl.float32)
    q, scale = quant_rows_fp8(act)
    start, rows = _segment(tl.where(live, r, 0), bexp_ptr, ends_ptr, BLOCK_M)
    tl.store(q_ptr + r[:, None] * inter + offs_i, q, mask=imask)
    tl.store(s_ptr + start * tl.cdiv(inter, GROUP) + offs_g * rows + (r - start), scale,
             mask=(offs_g * GROUP < inter) & live)


def quant_scatter_segments(x: torch.Tensor, route: tuple, top_k: int, block_m: int) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
    """(A1 e4m3 [rows_pad, H], its scales flat [rows_pad * H/128] in per-expert blocks: see `expert_scales`)."""
    (t, h), rows_pad = x.shape, route[0].numel()
    kg = triton.cdiv(h, FP8_BLOCK)
    q = torch.empty(rows_pad, h, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(rows_pad * kg, dtype=torch.float32, device=x.device)
    gpp = groups_per_prog(h)
    if t:
        _quant_scatter_segments_kernel[(t, triton.cdiv(kg, gpp))](
            x, q, s, route[3], route[1], route[4], h, x.stride(0), TOP_K=top_k, BLOCK_M=block_m, GROUP=FP8_BLOCK,
            GROUPS_PER_PROG=gpp, **pdl_args(x.device))
    return q, s


def silu_mul_quant_segments(h13: torch.Tensor, route: tuple, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h13 [rows_pad, 2I] bf16 gate|up -> (act e4m3 [rows_pad, I], scales flat in per-expert blocks)."""
    rows_pad, inter = h13.shape[0], h13.shape[1] // 2
    kg = triton.cdiv(inter, FP8_BLOCK)
    q = torch.empty(rows_pad, inter, dtype=torch.float8_e4m3fn, device=h13.device)
    s = torch.empty(rows_pad * kg, dtype=torch.float32, device=h13.device)
    gpp = groups_per_prog(inter)
    rpp = SILU_ROWS_PER_PROG if gpp >= 4 else 1
    if rows_pad:
        _silu_mul_quant_segments_kernel[(triton.cdiv(rows_pad, rpp), triton.cdiv(kg, gpp))](
            h13, q, s, route[1], route[4], route[2], inter, h13.stride(0), BLOCK_M=block_m, GROUP=FP8_BLOCK,
            GROUPS_PER_PROG=gpp, ROWS_PER_PROG=rpp, **pdl_args(h13.device))
    return q, s


def expert_scales(flat: torch.Tensor, start: int, rows: int, k: int) -> torch.Tensor:
    """Expert rows [start, start + rows)'s activation scales as `_scaled_mm` takes them: (rows, K/128), stride
    (1, rows)."""
    kg = triton.cdiv(k, FP8_BLOCK)
    return flat.as_strided((rows, kg), (1, rows), flat.storage_offset() + start * kg)


def expert_weights(w: torch.Tensor, w_s: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """([w[e]^T], [w_s[e]^T]) for every expert, as `_scaled_mm` takes them; made once and kept on w (a layer's
    experts are read by every prefill: the views cost host time, and the host bounds this path)."""
    views = getattr(w, _WEIGHT_VIEWS, None)
    if views is None or views[0] is not w_s:
        views = (w_s, [v.t() for v in w.unbind(0)], [v.t() for v in w_s.unbind(0)])
        setattr(w, _WEIGHT_VIEWS, views)
    return views[1], views[2]


def run_bounds(ends: torch.Tensor) -> tuple[torch.Tensor | list[int], torch.cuda.Event | None]:
    """Start copying the experts' run ends to the host without waiting: (pinned host tensor, the event its copy
    records); on the CPU (the values themselves, None)."""
    if not ends.is_cuda:
        return ends.tolist(), None
    host = torch.empty(ends.shape, dtype=ends.dtype, pin_memory=True)
    host.copy_(ends, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


def expert_runs(host: torch.Tensor | list[int], done: torch.cuda.Event | None) -> list[tuple[int, int, int]]:
    """(expert, first row, rows) of every expert with rows, once the copy `run_bounds` started has landed."""
    if done is not None:
        done.synchronize()
        host = host.tolist()
    runs, start = [], 0
    for e, end in enumerate(host):
        if end > start:
            runs.append((e, start, end - start))
        start = end
    return runs


def expert_gemms(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, w_s: torch.Tensor, out: torch.Tensor,
                 runs: list[tuple[int, int, int]]) -> None:
    """out[rows of e] = (a[rows of e] @ dequant(w[e])^T), one block-scaled `scaled_mm` an expert run."""
    sizes = [rows for _, _, rows in runs]
    total, k = sum(sizes), a.shape[1]
    w_t, ws_t = expert_weights(w, w_s)
    for (e, start, rows), a_e, out_e in zip(runs, a[:total].split(sizes), out[:total].split(sizes), strict=True):
        scaled_mm(a_e, w_t[e], expert_scales(a_s, start, rows, k), ws_t[e], out_dtype=out.dtype, out=out_e)


def use_cublas(cfg: dict, x: torch.Tensor, num_experts: int, inter: int, pairs: int) -> bool:
    """Whether `fused_moe` takes this module rather than `triton_moe_prefill` (PREFILL_CONFIG's "gemm"; "cublas"
    forced on shapes cuBLAS cannot take is an error)."""
    choice, h = cfg["gemm"], x.shape[1]
    if choice not in GEMM_CHOICES:
        raise ValueError(f"fused_moe: gemm (DSASERVE_MOE_PREFILL_GEMM) is one of {GEMM_CHOICES}, "
                         f"got {choice!r}")
    shapes = scaled_mm_shape_ok(2 * inter, h) and scaled_mm_shape_ok(h, inter) and cfg["block_m"] % 16 == 0
    if choice == "cublas" and not shapes:
        raise ValueError(f"fused_moe: gemm 'cublas' needs H {h} and I {inter} multiples of 512 and "
                         f"block_m {cfg['block_m']} a multiple of 16")
    if choice != "auto":
        return choice == "cublas"
    return (shapes and scaled_mm_ok(h, inter, x.device) and not torch.cuda.is_current_stream_capturing()
            and pairs >= cfg["cublas_min_rows"] * num_experts)


def moe_prefill_cublas(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                       w2_scale: torch.Tensor, topk_weights: torch.Tensor, route: tuple, top_k: int,
                       add: torch.Tensor | None, cfg: dict) -> torch.Tensor:
    """`fused_moe` for FP8 experts over `align_route(ids, E, cfg["block_m"])`'s route: x [T, H] -> [T, H]."""
    bm, rows_pad, inter = cfg["block_m"], route[0].numel(), w13.shape[1] // 2
    bounds = run_bounds(route[4])  # queued before the permute: the GPU runs it while the host waits
    a1, a1_s = quant_scatter_segments(x, route, top_k, bm)
    runs = expert_runs(*bounds)
    h13 = torch.empty(rows_pad, 2 * inter, dtype=torch.bfloat16, device=x.device)
    expert_gemms(a1, a1_s, w13, w13_scale, h13, runs)
    del a1, a1_s  # each buffer freed once read: the peak is two of them (a 128K-token chunk's are GBs)
    act, act_s = silu_mul_quant_segments(h13, route, bm)
    del h13
    out = torch.empty(rows_pad, x.shape[1], dtype=torch.bfloat16, device=x.device)
    expert_gemms(act, act_s, w2, w2_scale, out, runs)
    del act, act_s
    return unpermute_combine(out, route[3], topk_weights, add, x.dtype)
