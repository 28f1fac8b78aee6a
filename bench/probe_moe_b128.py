"""Where batch-128 decode's MoE layer goes, stage by stage, and the A-operand kernel's other tiles per GEMM (issue
17: the MoE is ~1.2 ms of the slice's 3.2 ms batch-128 step, ~400 µs a layer against ~285 µs of expert bytes).

Run on the device:  PYTHONPATH=. python bench/probe_moe_b128.py --out $OUT [--tokens 128]
Each case is a CUDA graph over `calls` routes (each its own random draw of TOP_K experts a token over all 32, as a
trained router spreads a batch), so the experts stream from HBM. Printed: µs a call, the expert bytes it must read
over that time, and that rate over the pure-read ceiling of the same run (`measure_ceilings`' read_Bps); "whole":
fused_moe with the shared expert (apart: past the unsorted kernel's sizes), the expert sort in one launch or four;
each output's relative difference from the default's (whole) or the shipped tiles' (GEMMs).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench.bench_kernels import graph_time, measure_ceilings
from bench.sweep_moe_decode import INTER, TOP_K, E, H, _route, slice_experts
from dsaserve.kernels import triton_fp8_gemm as G
from dsaserve.kernels import triton_moe as MOE
from dsaserve.kernels import triton_moe_align as A


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want.float()).norm() / want.float().norm()).item())


def _gemm_cases(stage: str) -> list[tuple[str, dict]]:
    """The shipped busy tiles, then the A-operand kernel's others (GEMM2, K = 2048, is 16 K blocks a tile)."""
    shipped = {**MOE.BUSY_CONFIG, **(MOE.BUSY_CONFIG.get("gemm2", {}) if stage == "gemm2" else {})}
    cases = [(f"shipped gemm bm64 bn{shipped['block_n']} w{shipped['num_warps']} st{shipped['num_stages']}", shipped)]
    bns = (64, 128) if stage == "gemm1" else (64, 128, 256)
    for bn, wp, st in itertools.product(bns, (4, 8), (3, 4, 5, 6)):
        if (bn, wp, st) != tuple(shipped[k] for k in ("block_n", "num_warps", "num_stages")) and not (
                stage == "gemm1" and bn == 128 and st > 4):  # gate + up tiles: no shared memory for more stages
            cases.append((f"gemm bm64 bn{bn} w{wp} st{st}", {"kernel": "gemm", "block_m": 64, "block_n": bn,
                                                             "num_warps": wp, "num_stages": st}))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=12)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2, shared, expert_bytes = slice_experts()
    ceilings = measure_ceilings()
    print({k: round(v / 1e12, 3) for k, v in ceilings.items()}, "(TB/s, TFLOP/s)", flush=True)
    t = args.tokens
    x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
    routes = [_route(t, gen) for _ in range(args.calls)]
    touched = sum(int(ids.unique().numel()) for _, ids in routes) / len(routes)
    b13 = touched * (w13[0].numel() + 4 * s13[0].numel())
    b2 = touched * (w2[0].numel() + 4 * s2[0].numel())
    rows: list[dict] = []

    def report(stage: str, tag: str, sec: float, nbytes: float, diff: float | None = None,
               conf: dict | None = None) -> None:
        row = {"stage": stage, "config": tag, "conf": conf, "us": sec * 1e6, "tb_s": nbytes / sec / 1e12,
               "of_read": nbytes / sec / ceilings["read_Bps"], "max_rel_diff": diff}
        rows.append(row)
        print(f"T={t} {stage:8s} {tag:40s} {row['us']:7.1f} us {row['tb_s']:.2f} TB/s ({row['of_read']:.2f} of read)"
              + (f" diff {diff:.1e}" if diff is not None else ""), flush=True)
        (args.out / "probe_moe_b128.json").write_text(json.dumps({"ceilings": ceilings, "touched": touched,
                                                                  "rows": rows}, indent=1))

    bm = MOE.BUSY_CONFIG["block_m"]
    xq = G.quant_act_fp8(x)
    aligned = [MOE.moe_align(ids, E, bm) for _, ids in routes]
    tws = [tw.reshape(-1).float().contiguous() for tw, _ in routes]
    pairs = t * TOP_K
    acts = [torch.empty(pairs, INTER, dtype=torch.bfloat16, device="cuda") for _ in routes]
    outs = [torch.empty(pairs, H, dtype=torch.bfloat16, device="cuda") for _ in routes]
    launch = {"block_m": bm, "block_n": 128, "num_warps": 8, "num_stages": 4, "kernel": "gemm"}  # the refs' tiles
    for route, act in zip(aligned, acts, strict=True):
        MOE._grouped_gemm(*xq, w13, s13, act, None, route, INTER, H, TOP_K, True, **launch)
    actq = [G.quant_act_fp8(a) for a in acts]

    sh_bytes = expert_bytes  # the shared expert has one routed expert's shape
    want = MOE.fused_moe(x, w13, s13, w2, s2, *routes[0], shared=shared)
    one_launch_pairs = A.ONE_LAUNCH_PAIRS
    for tag, one_launch in (("default (one-launch sort)", True), ("four-launch sort", False)):
        A.ONE_LAUNCH_PAIRS = one_launch_pairs if one_launch else 0
        got = MOE.fused_moe(x, w13, s13, w2, s2, *routes[0], shared=shared)
        diff = _rel(got, want)
        report("whole", tag, graph_time([lambda tw=tw, ids=ids: MOE.fused_moe(x, w13, s13, w2, s2, tw, ids,
                                                                               shared=shared)
                                         for tw, ids in routes]), b13 + b2 + sh_bytes, diff)
    A.ONE_LAUNCH_PAIRS = one_launch_pairs
    for tag, one_launch in (("one launch", True), ("four launches", False)):
        A.ONE_LAUNCH_PAIRS = one_launch_pairs if one_launch else 0
        report("align", f"moe_align bm{bm} {tag}",
               graph_time([lambda ids=ids: MOE.moe_align(ids, E, bm) for _, ids in routes]), 0)
    A.ONE_LAUNCH_PAIRS = one_launch_pairs
    report("quant", "quant_act_fp8 x", graph_time([lambda: G.quant_act_fp8(x)] * len(routes)), 0)
    report("quant", "quant_act_fp8 act", graph_time([lambda a=a: G.quant_act_fp8(a) for a in acts]), 0)
    ref1 = [a.clone() for a in acts]
    ref2 = []
    for route, aq, tw, out in zip(aligned, actq, tws, outs, strict=True):
        MOE._grouped_gemm(*aq, w2, s2, out, tw, route, H, INTER, 1, False, **launch)
        ref2.append(out.clone())
    stages = {"gemm1": (lambda i, c: MOE._grouped_gemm(*xq, w13, s13, acts[i], None, aligned[i], INTER, H, TOP_K,
                                                       True, **c), acts, ref1, b13),
              "gemm2": (lambda i, c: MOE._grouped_gemm(*actq[i], w2, s2, outs[i], tws[i], aligned[i], H, INTER, 1,
                                                       False, **c), outs, ref2, b2)}
    for stage, (call, dst, ref, nbytes) in stages.items():
        for tag, conf in _gemm_cases(stage):
            lc = {"block_m": bm, **{k: conf[k] for k in ("block_n", "num_warps", "num_stages", "kernel")}}
            try:
                call(0, lc)
                diff = _rel(dst[0], ref[0])
                sec = graph_time([lambda i=i, f=call, c=lc: f(i, c) for i in range(len(routes))])
            except Exception as exc:  # noqa: BLE001 - a config that does not fit is a data point
                print(t, stage, tag, "failed", repr(exc)[:160], flush=True)
                continue
            report(stage, tag, sec, nbytes, diff, conf)


if __name__ == "__main__":
    main()
