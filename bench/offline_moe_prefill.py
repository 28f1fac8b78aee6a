"""Offline sm_90 compile of the MoE prefill grouped GEMMs (`triton_moe_prefill`): registers, spills and shared
memory of GEMM1 and GEMM2 for a sweep variant, without a GPU (bench/offline_sm90.py's technique).

Run anywhere Triton is installed:  PYTHONPATH=. python bench/sweep_moe_prefill.py --offline [--only NAME,..]
Launch arguments come from `triton_moe_prefill.gemm_plan` on CPU tensors of glm-5.3-slice's expert shapes (a
few experts, 512 tokens: only pointer / descriptor types and the divisibility of integers reach the compiler,
as in the GPU launch); TMA descriptors are typed by Triton's own `mangle_type`.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from triton.runtime.jit import mangle_type

from bench.offline_compile import compile_sm90, ptxas
from dsaserve.kernels import triton_moe as MOE
from dsaserve.kernels import triton_moe_align as A
from dsaserve.kernels import triton_moe_prefill as P

E, H, INTER, TOP_K, T = 2, 6144, 2048, 8, 512


def plans(conf: dict) -> list[tuple[str, int, tuple, dict]]:
    cfg = {**P.PREFILL_CONFIG, **conf}
    ids = torch.randint(0, E, (T, TOP_K))
    route = MOE.moe_align(ids, E, cfg["block_m"])
    rows = route[0].numel()
    f8 = torch.float8_e4m3fn
    w13, s13 = torch.zeros(E, 2 * INTER, H, dtype=f8), torch.ones(E, 2 * INTER // 128, H // 128)
    w2, s2 = torch.zeros(E, H, INTER, dtype=f8), torch.ones(E, H // 128, INTER // 128)
    a1, a1_s = torch.zeros(rows, H, dtype=f8), torch.ones(H // 128, rows)
    fused = cfg["bn1"] == 128
    act = torch.zeros(rows, INTER, dtype=f8 if fused else torch.bfloat16)
    act_s = torch.ones(INTER // 128, rows)
    out = torch.zeros(rows, H, dtype=torch.bfloat16)
    return [("gemm1", *P.gemm_plan(a1, a1_s, w13, s13, act, act_s if fused else None, route, INTER, True, cfg, 1)),
            ("gemm2", *P.gemm_plan(act.to(f8), act_s, w2, s2, out, None, route, H, False, cfg, 2))]


def compile_one(args: tuple, meta: dict, fn=P._grouped_fp8_gemm_kernel) -> str:
    kernel = compile_sm90(fn, args, meta, mangle_type)
    with tempfile.TemporaryDirectory() as tmp:
        regs, spill, _ = ptxas(kernel, Path(tmp))
    wgmma = kernel.asm["ptx"].count("wgmma.mma_async")
    return (f"smem {kernel.metadata.shared / 1024:6.1f} KB regs {regs:>3s} spill st/ld {spill[0]}/{spill[1]} "
            f"wgmma {wgmma}")


def report(name: str, conf: dict) -> str:
    if conf.get("kernel") != "dense":
        return f"{name:30s} (not a dense variant)"
    parts = []
    for gemm, _, args, meta in plans(conf):
        try:
            parts.append(f"{gemm}: {compile_one(args, meta)}")
        except Exception as ex:  # noqa: BLE001 - a variant that does not compile is a result
            parts.append(f"{gemm}: FAILED {type(ex).__name__}: {str(ex)[:200]}")
    return f"{name:30s} " + " | ".join(parts)


def data_movement_plans() -> list[tuple[str, object, tuple, dict]]:
    """The expert sort's three kernels and the token-driven permute at the sweep's T=4096 (32 experts, top-8):
    (name, kernel, arguments, meta) as `align_route` / `permute_quant` launch them."""
    n, e, bm, h, t = 4096 * TOP_K, 32, 128, H, 4096
    bins, chunk, chunks = 64, A.ALIGN_CHUNK, n // A.ALIGN_CHUNK
    max_blocks = -(-(n + (e + 1) * (bm - 1)) // bm)
    i32 = torch.int32
    ids, counts = torch.zeros(n, dtype=torch.int64), torch.zeros(chunks, bins, dtype=i32)
    pend, total, pos = torch.zeros(bins, dtype=i32), torch.zeros(1, dtype=i32), torch.zeros(n, dtype=i32)
    sorted_ids, bexp = torch.zeros(max_blocks * bm, dtype=i32), torch.zeros(max_blocks, dtype=i32)
    x, q = torch.zeros(t, h, dtype=torch.bfloat16), torch.zeros(max_blocks * bm, h, dtype=torch.float8_e4m3fn)
    s = torch.zeros(h // 128, max_blocks * bm)
    w = dict(num_warps=4, num_stages=3)
    return [("align count", A._align_count_kernel, (ids, counts, n), dict(BINS=bins, CHUNK=chunk, **w)),
            ("align scan", A._align_scan_kernel, (counts, counts, pend, total, chunks, e),
             dict(BINS=bins, CB=32, BLOCK_M=bm, **w)),
            ("align scatter", A._align_scatter_kernel,
             (ids, counts, pend, sorted_ids, pos, bexp, n, chunks, e, max_blocks),
             dict(BINS=bins, CHUNK=chunk, BLOCK_M=bm, NB=256, **w)),
            ("permute token", P._quant_scatter_kernel, (x, q, s, pos, h, h, max_blocks * bm),
             dict(TOP_K=TOP_K, GROUP=128, GROUPS_PER_PROG=P.PERMUTE_GROUPS, **w))]


def report_data_movement() -> str:
    """sm_90 compile report of `data_movement_plans` (registers, spills), one line a kernel."""
    lines = []
    for name, fn, args, meta in data_movement_plans():
        try:
            lines.append(f"{name:30s} {compile_one(args, meta, fn)}")
        except Exception as ex:  # noqa: BLE001 - a kernel that does not compile is a result
            lines.append(f"{name:30s} FAILED {type(ex).__name__}: {str(ex)[:200]}")
    return "\n".join(lines)
