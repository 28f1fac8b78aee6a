"""Where one token's sparse MLA tile spends its ~12 µs (issue 17: the batch-1 full-row tile, `FULL_ROW_CONFIG`: 64
heads, 64 keys, 32 splits of one tile each), by what its inputs let it skip, graph-timed like a decode step's call
(`--calls` launches back to back in one CUDA graph, each with its own query; split partials left for W_uv's fold, no
combine launch, as in the step):
  hbm      2048 random rows of a 1.4 GB pool (the step's case at 32K+: the rows come from HBM)
  l2       the same 2048 rows in every call (after the first, they sit in L2)
  one_row  every slot the same row (one line set: the gather's latency at its least)
  masked   every slot -1 under the static split (each program runs its tile's dots on masked loads: no gather)
  one_split the 2048 rows as one program's 32 tiles (the per-tile cost of the loop when nothing else waits)
The gaps between the cases are the gather's HBM latency (hbm - l2), its L2 latency (l2 - masked) and the fixed
chain of a program (masked). Prints µs a call; writes probe_one_token_mla.json under --out.

    PYTHONPATH=. python bench/probe_one_token_mla.py --out DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.bench_long_select import _graph_time
from dsaserve.common.kv_layout import encode_latent, get_kv_layout
from dsaserve.kernels import triton_sparse_mla as tsm

H, DC, DR, TOPK = 64, 512, 64, 2048
FP8 = get_kv_layout("fp8_ds_mla")


def case_slots(name: str, calls: int, pool_rows: int) -> torch.Tensor:
    """[calls, 1, TOPK] int64 slots of one case (module docstring)."""
    if name in ("hbm", "one_split"):
        return torch.randint(0, pool_rows, (calls, 1, TOPK), device="cuda")
    if name == "l2":
        return torch.randint(0, pool_rows, (1, 1, TOPK), device="cuda").expand(calls, 1, TOPK).contiguous()
    if name == "one_row":
        return torch.full((calls, 1, TOPK), 7, dtype=torch.int64, device="cuda")
    if name == "masked":
        return torch.full((calls, 1, TOPK), -1, dtype=torch.int64, device="cuda")
    raise ValueError(f"probe_one_token_mla: unknown case {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cases", default="hbm,l2,one_row,masked,one_split")
    args = ap.parse_args()
    torch.manual_seed(0)
    cache = torch.cat([encode_latent(torch.randn(1 << 18, DC + DR, device="cuda"), FP8, DC) for _ in range(8)])
    qn = torch.randn(args.calls, 1, H, DC, device="cuda", dtype=torch.bfloat16)
    qr = torch.randn(args.calls, 1, H, DR, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(qn)
    rows = {}
    for name in args.cases.split(","):
        slots = case_slots(name, args.calls, cache.shape[0])
        cfg = {**tsm.FULL_ROW_CONFIG, **({"splits": 1} if name == "one_split" else {})}

        def calls(slots=slots, cfg=cfg):
            for i in range(args.calls):
                tsm.sparse_mla_attention(qn[i], qr[i], cache, FP8, slots[i], 0.04, DC, out=out[i], config=cfg,
                                         defer_combine=True)

        rows[name] = _graph_time(calls, args.reps) * 1e6 / args.calls
        print(f"{name:10s} {rows[name]:7.2f} us a call", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe_one_token_mla.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
