"""Where batch-128 sparse MLA's time goes (issue 17): the Gluon kernels at a decode batch over the fp8_ds_mla cache
and over a bf16 cache of the same rows, each with its rows in HBM (a pool far past L2, as a decode batch's caches
are) and in L2 (a pool of a few MB that every token's slots pick from).

Reading the 2 x 2: fp8 against bf16 in L2 is the dequantisation's cost (bf16 rows carry no scales, twice the
bytes); HBM against L2 is the gather's. Each cell is timed as CUDA graph replays (`do_bench_cudagraph`; --eager:
`do_bench`, whose ~100 us a call from Python hid the kernels at 1024 keys) (split 1: one program a token, as
`pick_splits` gives at 128 tokens), TFLOP/s over the valid keys (2 x 64 heads x (2 x 512 + 64) a key).

Run on the device:  PYTHONPATH=. python bench/probe_sparse_mla_b128.py --out DIR
  --pages: each token's keys whole 64-slot pages, in order (a batch within the top-k), not random rows; H100
  (forty-third session): the decode-schedule fp8 kernel 69.0 us at 128 x 1024 keys from HBM, 75.4 over random rows.
  --ncu: only the fp8 and bf16 single-partition kernels over the HBM pool, twice each, for
  ncu --kernel-name regex:'_sparse_mla' --launch-skip 1 ... (nothing else launched from dsaserve).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

from bench.sweep_decode_splits import DC, DR, FP8, H, case
from dsaserve.common.kv_layout import encode_latent
from dsaserve.kernels import gluon_sparse_mla as G

HBM_ROWS, L2_ROWS = 1 << 21, 1 << 14  # 1.4 GB / 10.7 MB of fp8 rows (2.4 GB / 18.9 MB as bf16)
KERNELS = {"fp8-single": ("fp8", {"ws": False}), "fp8-ws": ("fp8", {"ws": True}),
           "fp8-dec": ("fp8", {"ws": "dec"}), "fp8-dec-late": ("fp8", {"ws": "dec", "ws_variant": {"PIN": True}}),
           "bf16-single": ("bf16", {"ws": False}), "bf16-ws": ("bf16", {"ws": True})}


def pools(rows: int) -> dict[str, torch.Tensor]:
    """The same latent rows as the fp8_ds_mla cache's bytes and as bf16 rows [rows, 576]."""
    fp8, b16 = [], []
    for r0 in range(0, rows, 1 << 17):
        x = torch.randn(min(1 << 17, rows - r0), DC + DR, device="cuda")
        fp8.append(encode_latent(x, FP8, DC))
        b16.append(x.to(torch.bfloat16))
    return {"fp8": torch.cat(fp8), "bf16": torch.cat(b16)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="probe-out")
    ap.add_argument("--tokens", default="128", help="token counts, comma-separated")
    ap.add_argument("--splits", type=int, default=1, help="top-k splits (0: launch_plan's pick)")
    ap.add_argument("--kernels", default=",".join(KERNELS))
    ap.add_argument("--eager", action="store_true", help="time launches from Python (do_bench), not graph replays: "
                    "at ~100 us a call the host's launch path, not the kernel, can be what is timed")
    ap.add_argument("--valid", default="2048,1024")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--pages", action="store_true", help="each token's keys whole 64-slot pages (a decode batch within "
                    "the top-k: every key of each request), not random rows")
    args = ap.parse_args()
    torch.manual_seed(0)
    where = {"hbm": (HBM_ROWS, pools(HBM_ROWS))} if args.ncu else {"hbm": (HBM_ROWS, pools(HBM_ROWS)),
                                                                   "l2": (L2_ROWS, pools(L2_ROWS))}
    rows = []
    for tokens, valid in ((int(t), int(v)) for t in args.tokens.split(",") for v in args.valid.split(",")):
        flop = 2.0 * H * (2 * DC + DR) * tokens * valid
        for place, (n_rows, pool) in where.items():
            slots, qn, qr = case(tokens, valid, n_rows)
            if args.pages:  # token t's keys: `valid` slots in random pages of 64 (distinct where the pool has
                # enough: the L2 pool's 256 pages are shared), each page in order
                need, have = tokens * -(-valid // 64), n_rows // 64
                page = (torch.randperm(have, device="cuda")[:need] if need <= have else
                        torch.randint(0, have, (need,), device="cuda")).view(tokens, -1)
                j = torch.arange(valid, device="cuda")
                slots[:, :valid] = (page[:, j // 64] * 64 + j % 64).to(torch.int32)
            for name in args.kernels.split(","):
                kind, cfg = KERNELS[name]
                if args.ncu and name.endswith("-ws"):
                    continue
                out = torch.empty_like(qn)

                def call(rows_in=pool[kind], cfg=cfg, slots=slots, qn=qn, qr=qr, out=out):
                    return G.sparse_mla_attention_gluon(qn, qr, rows_in, slots, 0.04, out,
                                                        {"splits": args.splits or None, **cfg})
                if args.ncu:
                    call()
                    call()
                    continue
                call()
                ms = do_bench(call, warmup=10, rep=60) if args.eager else do_bench_cudagraph(call, rep=60)
                res = {"tokens": tokens, "valid": valid, "rows": place, "kernel": name, "splits": args.splits,
                       "slots": "pages" if args.pages else "random",
                       "timing": "eager" if args.eager else "graph",
                       "us": round(ms * 1e3, 1), "tflops": round(flop / ms / 1e9, 1)}
                rows.append(res)
                print(res, flush=True)
        if args.ncu:
            break
    torch.cuda.synchronize()
    if rows:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "probe_sparse_mla_b128.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
