"""Is the fused MoE's A-operand kernel (`triton_moe._moe_gemm_kernel`: tokens as the MMA's M, a 128-block
weight scale each K step) a faster dense FP8 GEMM than quant + cuBLAS `_scaled_mm` at decode batches of 33-256
rows (issue 17: at batch 128 GLM-5.3's projections on cuBLAS add ~860 us a step for ~445 us of weight bytes)?

Run on the device:  PYTHONPATH=. python bench/sweep_dense_moe_gemm.py --out $OUT [--m 128]
Each projection of a decode step as one "expert" of M rows (its rows in 64- or 128-row blocks), every config
checked against `fp8_linear` first, timed as CUDA-graph replays over enough weight copies to defeat the L2;
each case includes its activation quantiser, as the dispatcher's does.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import triton

from bench.bench_kernels import copies_for, graph_time
from bench.sweep_skinny import SHAPES
from dsaserve.kernels import triton_fp8_gemm as G
from dsaserve.kernels import triton_moe as M
from dsaserve.weights.fp8 import quantize_fp8_block


def expert_route(m: int, block_m: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align`'s (sorted ids, block expert, total) for one expert whose pairs are rows 0..m-1."""
    blocks = triton.cdiv(m, block_m)
    ids = torch.arange(blocks * block_m, device=device, dtype=torch.int32)
    return (torch.where(ids < m, ids, m), torch.zeros(blocks, dtype=torch.int32, device=device),
            torch.full((1,), blocks * block_m, dtype=torch.int32, device=device))  # pads name no row: masked


def dense_as_expert(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, route, block_m: int, block_n: int,
                    warps: int, stages: int) -> torch.Tensor:
    """x [m, K] @ w [N, K]^T (block scales s) by the MoE kernel: one expert whose pairs are the rows."""
    m, (n, k) = x.shape[0], w.shape
    a, a_s = G.quant_act_fp8(x)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    M._grouped_gemm(a, a_s, w[None], s[None], out, None, route, n, k, 1, False, block_m, block_n, warps, stages,
                    "gemm")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--m", default="128")
    args = ap.parse_args()
    rows, summary = [], {}
    for (name, (n, k)), m in itertools.product(SHAPES.items(), [int(v) for v in args.m.split(",")]):
        w, s = quantize_fp8_block(torch.randn(n, k, device="cuda"))
        wbytes = n * k + 4 * s.numel()
        ws = [(w.clone(), s.clone()) for _ in range(copies_for(wbytes, cap=48))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = G.fp8_linear(x, w, s).float()
        base = graph_time([functools.partial(G.fp8_linear, x, w, s) for w, s in ws])
        best = None
        for bm, bn, wp, st in itertools.product((64, 128), (64, 128, 256), (4, 8), (3, 4, 5)):
            tag = f"bm{bm} bn{bn} w{wp} st{st}"
            try:
                route = expert_route(m, bm, x.device)
                got = dense_as_expert(x, w, s, route, bm, bn, wp, st).float()
                err = float((got - ref).norm() / ref.norm())
                if err > 2e-2:
                    print(name, m, tag, "wrong", err)
                    continue
                t = graph_time([functools.partial(dense_as_expert, x, w, s, route, bm, bn, wp, st) for w, s in ws])
            except Exception as e:  # noqa: BLE001 - a config that does not fit is a data point
                print(name, m, tag, "failed", repr(e)[:100])
                continue
            row = {"shape": name, "n": n, "k": k, "m": m, "config": tag, "us": t * 1e6, "cublas_us": base * 1e6}
            rows.append(row)
            best = row if best is None or row["us"] < best["us"] else best
        summary[f"{name} M={m}"] = (base * 1e6, best and best["us"], best and best["config"])
        print(f"{name:28s} M={m:3d}: quant + _scaled_mm {base * 1e6:6.1f} us ({wbytes / base / 1e12:.2f} TB/s) | "
              f"MoE kernel best {best['us']:6.1f} us ({wbytes / best['us'] / 1e6:.2f} TB/s) {best['config']}",
              flush=True)
        del ws
        (args.out / "sweep_dense_moe_gemm.json").write_text(json.dumps(rows, indent=1))
    print("sum of shapes:", {m: (round(sum(v[0] for k, v in summary.items() if k.endswith(f"M={m}")), 1),
                                 round(sum(v[1] for k, v in summary.items() if k.endswith(f"M={m}")), 1))
                             for m in args.m.split(",")})


if __name__ == "__main__":
    main()
