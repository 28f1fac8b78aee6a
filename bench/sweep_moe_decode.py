"""Tile sweep of the decode MoE (`fused_moe`'s unsorted swap-AB kernel) at the slice's MoE layer, batch 1-8
(issue 17: batch-1 decode streams its routed experts at ~3.5 TB/s); --wide: batch 32-128 (the sorted kernels);
--hot 32,12: routes over all 32 experts, then over 12 (the slice's batch 128 touches ~12); --only: a tag regex.

Run on the device:  PYTHONPATH=. python bench/sweep_moe_decode.py --out $OUT [--tokens 1,8]
Each case is a CUDA graph over `calls` MoE calls, each its own random route over 32 FP8 experts (hidden 6144,
expert width 2048, top-8, the shared expert fused or apart), so the experts come from HBM as in a step. Printed:
µs a call and the bytes it must read (the touched experts, the shared one, their scales) over that time,
beside the copy ceiling measured in the same run; every config's output is checked against the default's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from pathlib import Path

import torch

from bench.bench_kernels import graph_time, measure_ceilings
from dsaserve.kernels import triton_fp8_gemm as G
from dsaserve.kernels import triton_moe as MOE
from dsaserve.kernels.reference import SharedExpert
from dsaserve.kernels.triton_elementwise import silu_and_mul
from dsaserve.weights.fp8 import quantize_fp8_block

E, H, INTER, TOP_K = 32, 6144, 2048, 8


def _route(t: int, gen: torch.Generator, hot: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's TOP_K experts drawn from the first `hot` (the slice's dummy router sends batch 128 to ~12)."""
    ids = torch.stack([torch.randperm(hot, generator=gen, device="cuda")[:TOP_K] for _ in range(t)])
    return torch.rand(t, TOP_K, generator=gen, device="cuda"), ids


def slice_experts() -> tuple:
    """The slice MoE layer's FP8 experts and shared expert (random weights, cuda): (w13, s13, w2, s2, shared,
    bytes of one expert with its scales)."""
    (w13, s13), (w2, s2) = (quantize_fp8_block(torch.randn(E, 2 * INTER, H, device="cuda") * 0.05),
                            quantize_fp8_block(torch.randn(E, H, INTER, device="cuda") * 0.05))
    (g13, t13), (g2, t2) = (quantize_fp8_block(torch.randn(2 * INTER, H, device="cuda") * 0.05),
                            quantize_fp8_block(torch.randn(H, INTER, device="cuda") * 0.05))
    shared = SharedExpert(g13, t13, g2, t2, lambda v: G.fp8_linear(silu_and_mul(G.fp8_linear(v, g13, t13)), g2, t2))
    return w13, s13, w2, s2, shared, 3 * H * INTER + 4 * (s13[0].numel() + s2[0].numel())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--only", default="", help="a regex: time only the configs whose tag it finds (and the default)")
    ap.add_argument("--hot", default=str(E), help="experts the routes draw from, e.g. 32,12 (several: each in turn)")
    ap.add_argument("--wide", action="store_true", help="batch 32-128 decode: the swap-AB and A-operand kernels' "
                    "block_m / block_n / warps / stages, and the dense prefill path, instead of the unsorted tiles")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2, shared, expert_bytes = slice_experts()
    ceilings = measure_ceilings()
    rows = []
    for t, hot in itertools.product((int(v) for v in args.tokens.split(",")), (int(v) for v in args.hot.split(","))):
        x = torch.randn(t, H, device="cuda", dtype=torch.bfloat16)
        routes = [_route(t, gen, hot) for _ in range(args.calls)]
        touched = sum(int(ids.unique().numel()) for _, ids in routes) / len(routes)
        for fused in (False,) if args.wide else (True, False):  # only the unsorted kernel fuses the shared expert
            base = {"fuse_shared": fused}
            want = [MOE.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared, config=base) for tw, ids in routes]
            cases = [("default", base)] + ([
                (f"{k} bm{bm} bn{bn} w{wp} st{st}", {**base, "kernel": k, "block_m": bm, "block_n": bn, "num_warps": wp,
                                                      "num_stages": st})
                for k, bm, bn, wp, st in itertools.product(("swap", "gemm"), (16, 32, 64), (64, 128), (4, 8), (3, 4))
            ] + [(f"swap pairs-fastest bm{bm}", {**base, "kernel": "swap", "block_m": bm, "pairs_fastest": True})
                 for bm in (16, 32, 64)] + [("dense", {**base, "kernel": "dense"})] if args.wide else [
                (f"bn{bn} w{wp} st{st}", {**base, "block_n": bn, "num_warps": wp, "num_stages": st})
                for bn, wp, st in itertools.product((32, 64, 128), (4, 8), (3, 4, 6))])
            for tag, conf in cases:
                if args.only and tag != "default" and not re.search(args.only, tag):
                    continue
                try:
                    got = MOE.fused_moe(x, w13, s13, w2, s2, *routes[0], shared=shared, config=conf)
                    ok = bool(torch.allclose(got.float(), want[0].float(), rtol=2e-2, atol=2e-2))
                    calls = [lambda tw=tw, ids=ids, c=conf, x=x: MOE.fused_moe(x, w13, s13, w2, s2, tw, ids,
                                                                               shared=shared, config=c)
                             for tw, ids in routes]
                    sec = graph_time(calls)
                except Exception as e:  # noqa: BLE001 - a config that does not fit is a data point
                    print(t, fused, tag, "failed", repr(e)[:120], flush=True)
                    continue
                nbytes = (touched + 1) * expert_bytes
                row = {"t": t, "hot": hot, "fused_shared": fused, "config": tag, "us": sec * 1e6, "same_as_default": ok,
                       "tb_s": nbytes / sec / 1e12, "of_copy": nbytes / sec / ceilings["copy_Bps"]}
                rows.append(row)
                print(f"T={t} hot={hot} fused={fused} {tag:16s} {row['us']:7.1f} us {row['tb_s']:.2f} TB/s "
                      f"({row['of_copy']:.2f} of copy) same={ok}", flush=True)
            (args.out / "sweep_moe_decode.json").write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
