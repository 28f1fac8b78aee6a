"""Tile sweeps of the decode FP8 GEMM (`skinny_gemm`) at the GLM-5.3 decode projections and (--mla) of
sparse MLA at batch 1 (issue 5).

Run on the device:  PYTHONPATH=. python bench/sweep_skinny.py --out $OUT [--m 1,8,32] [--mla]
For every projection a decode step runs (after merging: q_a+kv_a+wk, gate+up) and each token count, it
times the dispatcher's choice and a grid of alternatives (block_n, warps, stages, split) as CUDA-graph
replays over enough weight copies to defeat the L2, and prints each one's read bandwidth and the best.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench.bench_kernels import copies_for, graph_time
from dsaserve.kernels import triton_fp8_gemm as G
from dsaserve.weights.fp8 import quantize_fp8_block

SHAPES = {  # name: (N, K) at GLM-5.3's per-layer sizes
    "qkv_a (q_a+kv_a+wk, padded)": (2816, 6144), "q_b": (16384, 2048), "idx_wq_b": (4096, 2048),
    "o_proj": (6144, 16384), "dense gate_up": (24576, 6144), "dense down": (6144, 12288),
    "shared gate_up": (4096, 6144), "shared down": (6144, 2048),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--m", default="1,32")
    ap.add_argument("--mla", action="store_true", help="sweep sparse MLA at batch 1 instead")
    ap.add_argument("--wide-grid", action="store_true", help="block_n 32-128, 4-8 warps, 4-8 stages, split 1-16")
    args = ap.parse_args()
    if args.mla:
        return sweep_sparse_mla(args.out)
    rows = []
    for (name, (n, k)), m in itertools.product(SHAPES.items(), [int(v) for v in args.m.split(",")]):
        w, s = quantize_fp8_block(torch.randn(n, k, device="cuda"))
        wbytes = n * k + 4 * s.numel()
        ws = [(w.clone(), s.clone()) for _ in range(copies_for(wbytes, cap=48))]
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        auto = G.skinny_config(m, n, k, G._sm_count(x))
        cases = [("auto", auto), ("fp8_linear (dispatcher)", None)]
        block_ms = (auto["block_m"], 128) if m > 64 else (auto["block_m"],)  # M = 128: one M block reads W once
        grid = ((32, 64, 128), (4, 8), (4, 6, 8), (1, 2, 3, 4, 6, 8, 12, 16)) if args.wide_grid else \
            ((64, 128), (4, 8), (4, 6), (1, 2, 4, 8))
        for bm, bn, wp, st, sp in itertools.product(block_ms, *grid):
            conf = dict(auto, block_m=bm, block_n=bn, num_warps=wp, num_stages=st, split=sp)
            cases.append((f"bm{bm} bn{bn} w{wp} st{st} split{sp}", conf))
        best = None
        for tag, conf in cases:
            try:
                t = graph_time([lambda w=w, s=s, c=conf, x=x: G.skinny_gemm(x, w, s, out_dtype=torch.bfloat16, **c)
                                if c else G.fp8_linear(x, w, s) for w, s in ws])
            except Exception as e:  # noqa: BLE001 - a config that does not fit is a data point
                print(name, m, tag, "failed", repr(e)[:120])
                continue
            row = {"shape": name, "n": n, "k": k, "m": m, "config": tag, "us": t * 1e6, "tb_s": wbytes / t / 1e12}
            rows.append(row)
            best = row if best is None or row["us"] < best["us"] else best
            if tag == "auto":
                auto_row = row
            if conf is None:
                disp_row = row
        print(f"{name:28s} M={m:3d}: auto {auto_row['us']:6.1f} us {auto_row['tb_s']:.2f} TB/s ({auto}) | "
              f"dispatcher {disp_row['us']:6.1f} us | best {best['us']:6.1f} us {best['tb_s']:.2f} TB/s "
              f"{best['config']}", flush=True)
        del ws
        (args.out / "sweep_skinny.json").write_text(json.dumps(rows, indent=1))  # each shape: a cut-off run keeps it


def sweep_sparse_mla(out: Path) -> None:
    """Sparse MLA decode at batch 1 (GLM-5.3: 64 heads, 512 + 64 latent, top-2048, half the slots real)."""
    from dsaserve.common.kv_layout import encode_latent
    from dsaserve.kernels import triton_sparse_mla as S

    h, dc, dr, k, n_slots = 64, 512, 64, 2048, 1 << 16
    cache = encode_latent(torch.randn(n_slots, dc + dr, device="cuda"), "fp8_ds_mla", dc)
    rows = []
    for real in (1025, 2048):
        q = torch.randn(1, h, dc, device="cuda", dtype=torch.bfloat16)
        qr = torch.randn(1, h, dr, device="cuda", dtype=torch.bfloat16)
        slots = [torch.randint(0, n_slots, (1, k), device="cuda") for _ in range(16)]
        for s in slots:
            s[:, real:] = -1
        cases = [("auto", None)]
        for bh, grouped, warps in ((16, False, 4), (16, False, 2), (32, False, 4), (64, True, 8)):
            for splits in (8, 16, 32, 64):
                for bk in (16, 32, 64):
                    cases.append((f"bh{bh} grouped{grouped} w{warps} splits{splits} bk{bk}",
                                  {"block_h": bh, "grouped": grouped, "num_warps": warps, "splits": splits,
                                   "block_k": bk}))
        for tag, conf in cases:
            try:
                calls = [lambda s=s, c=conf, q=q, qr=qr: S.sparse_mla_attention(q, qr, cache, "fp8_ds_mla", s, 0.1,
                                                                                 dc, config=c) for s in slots]
                t = graph_time(calls)
            except Exception as e:  # noqa: BLE001
                print("mla", tag, "failed", repr(e)[:120])
                continue
            rows.append({"real_slots": real, "config": tag, "us": t * 1e6})
        best = sorted((r for r in rows if r["real_slots"] == real), key=lambda r: r["us"])[:4]
        auto = next(r for r in rows if r["real_slots"] == real and r["config"] == "auto")
        print(f"sparse MLA T=1, {real} slots: auto {auto['us']:.1f} us | " +
              " | ".join(f"{r['config']} {r['us']:.1f}" for r in best), flush=True)
    (out / "sweep_sparse_mla.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
