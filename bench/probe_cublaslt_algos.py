"""Every algorithm cuBLASLt's heuristic offers for the decode projections, timed against the one torch runs (issue 17).

At batch 64-128 the slice's FP8 projections run through `torch._scaled_mm`, which takes the heuristic's first
algorithm: at 128 rows a 128 x 128 tile a CTA over the whole K, 1.9-2.0 TB/s for o_proj on an H100 (forty-second
session). This lists up to `--count` candidates a shape (`dsaserve.kernels.cublaslt.Gemm.algos`), checks each
against `_scaled_mm`'s output and times it as a CUDA graph over weight copies past the L2 (as
`probe_scaled_mm_rows.py` does), beside `_scaled_mm` itself. `--bf16`: the bf16 lm_head too (F.linear against each
candidate).

Run on the device:  PYTHONPATH=. python bench/probe_cublaslt_algos.py --out $OUT [--rows 64,128] [--count 32]
Writes probe_cublaslt_algos.json.
"""

# ruff: noqa: B023  (the closures below are called at once by _time_candidates, inside their loop iteration)
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.bench_kernels import graph_time, probe_start
from bench.probe_scaled_mm_rows import SHAPES, _mm, weight_copies
from dsaserve.kernels.cublaslt import Gemm
from dsaserve.kernels.triton_fp8_gemm import quant_act_fp8

LM_HEAD = ("lm_head", 154880, 6144)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want.float()).norm() / want.float().norm()).item())


def _time_candidates(gemm: Gemm, want: torch.Tensor, run_one, calls_of, t_ref: float, nbytes: int,
                     head: dict, out: list[dict], count: int, scales: tuple = (None, None)) -> None:
    """Each candidate: checked against `want`, then graph-timed; one row each in `out`."""
    try:
        cands = gemm.algos(count, *scales)
    except Exception as e:  # noqa: BLE001 - a refused shape must not stop the other shapes
        print(f"{head}: heuristic refused: {type(e).__name__}: {e}", flush=True)
        return
    for i, cand in enumerate(cands):
        cfg = cand.config()
        try:
            rel = _rel(run_one(cand.algo), want)
            t = graph_time(calls_of(cand.algo)) if rel < 2e-2 else float("nan")
        except Exception as e:  # noqa: BLE001
            print(f"  #{i:2d} {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        out.append({**head, "index": i, **cfg, "waves": cand.waves, "workspace": cand.workspace, "rel": rel,
                    "us": t * 1e6, "torch_us": t_ref * 1e6})
        print(f"  #{i:2d} tile {cfg['tile']:3d} split {cfg['split_k']:2d} red {cfg['reduction']} stages "
              f"{cfg['stages']:3d} cluster {cfg['cluster']:2d} swz {cfg['swizzle']} custom {cfg['custom']:2d} "
              f"waves {cand.waves:5.2f} ws {cand.workspace >> 10:6d} KB: {t * 1e6:7.2f} us "
              f"({nbytes / t / 1e12:.2f} TB/s, {t_ref / t:.2f}x torch), rel {rel:.1e}", flush=True)


def fp8_shape(name: str, n: int, k: int, rows: list[int], out: list[dict], count: int) -> None:
    ws, nbytes = weight_copies(n, k)
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        a, a_s = quant_act_fp8(x, pad_m_to=16, scale_m_major=True)
        mp = a.shape[0]
        want = _mm(a, a_s, *ws[0], mp)
        t_ref = graph_time([functools.partial(_mm, a, a_s, w, s, mp) for w, s in ws])
        print(f"{name} m {m} (padded {mp}): _scaled_mm {t_ref * 1e6:.2f} us ({nbytes / t_ref / 1e12:.2f} TB/s)",
              flush=True)
        for tokens_as_a in (False, True):  # torch's operand order, then cuBLAS's sample's (y^T written)
            gemm = Gemm(mp, n, k, fp8=True, tokens_as_a=tokens_as_a)
            y = torch.empty(*gemm.out_shape, device="cuda", dtype=torch.bfloat16)

            def run_one(algo, w=ws[0][0], s=ws[0][1]):
                got = gemm.run(algo, a, w, y, x_scale=a_s, w_scale=s)
                return got.t() if gemm.tokens_as_a else got

            def calls_of(algo):
                return [functools.partial(gemm.run, algo, a, w, y, a_s, s) for w, s in ws]

            _time_candidates(gemm, want, run_one, calls_of, t_ref, nbytes,
                             {"shape": name, "n": n, "k": k, "m": m, "dtype": "fp8", "tokens_as_a": tokens_as_a},
                             out, count, (a_s, ws[0][1]))


def bf16_shape(name: str, n: int, k: int, rows: list[int], out: list[dict], count: int) -> None:
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02  # 1.9 GB at the lm_head: past the L2
    nbytes = 2 * n * k
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x, w)
        t_ref = graph_time([functools.partial(F.linear, x, w)])
        print(f"{name} m {m}: F.linear {t_ref * 1e6:.2f} us ({nbytes / t_ref / 1e12:.2f} TB/s)", flush=True)
        gemm = Gemm(m, n, k, fp8=False)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        _time_candidates(gemm, want, lambda algo: gemm.run(algo, x, w, y),
                         lambda algo: [functools.partial(gemm.run, algo, x, w, y)], t_ref, nbytes,
                         {"shape": name, "n": n, "k": k, "m": m, "dtype": "bf16"}, out, count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--shapes", default="", help="projections by name, comma-separated (default: all)")
    ap.add_argument("--bf16", default="", help="lm_head rows, e.g. 1,128 (default: none)")
    args = ap.parse_args()
    ceilings = probe_start(args.out)
    rows: list[dict] = []
    wanted = set(args.shapes.split(",")) if args.shapes else None
    for name, n, k in SHAPES:
        if wanted is None or name in wanted:
            fp8_shape(name, n, k, [int(v) for v in args.rows.split(",")], rows, args.count)
    if args.bf16:
        bf16_shape(*LM_HEAD, [int(v) for v in args.bf16.split(",")], rows, args.count)
    (args.out / "probe_cublaslt_algos.json").write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
