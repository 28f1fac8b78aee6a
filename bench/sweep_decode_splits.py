"""Sweep of the flash-decoding split for sparse MLA over the fp8_ds_mla cache at decode batches (issue 17): the
single-partition Gluon fp8 kernel (`gluon_sparse_mla`) and the warp-specialised one (`gluon_sparse_mla_ws_fp8`) —
one program a token and 64 heads, ~225 KB of shared memory: one program an SM — at each split count, beside the
split `launch_plan` picks, split combine included.

Run on the device (~1 min on an H200):  PYTHONPATH=. python bench/sweep_decode_splits.py --out DIR
Decode shape: every token is its own request, its `valid` keys at random slots of a pool of 64K pages (no two
tokens share keys, as in a decode batch), the rest of its top-2048 -1. TFLOP/s over the valid keys (2 x 64 heads
x (2 x 512 + 64) a key). Writes sweep_decode_splits.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from dsaserve.common.kv_layout import encode_latent, get_kv_layout
from dsaserve.kernels import gluon_sparse_mla as G
from dsaserve.kernels.triton_fp8_gemm import num_sms

H, DC, DR, TOPK = 64, 512, 64, 2048
FP8 = get_kv_layout("fp8_ds_mla")
BATCHES = (16, 32, 64, 128, 256)
VALID = (1024, 2048)  # a 1K context; a context past the top-k
SPLITS = (1, 2, 3, 4, 6, 8)


def _configs() -> list[tuple[str, dict]]:
    """(name, config): the single-partition fp8 kernel ("sN") and the warp-specialised one with PIN ("wsN") at each
    split N, and the warp-specialised one with PIN and rows prefetched into L2 A rounds ahead ("l2aA-sN")."""
    pin = {"ws": True, "ws_variant": {"PIN": True}}
    return ([(f"s{s}", {"splits": s, "ws": False}) for s in SPLITS]
            + [(f"ws{s}", {**pin, "splits": s}) for s in SPLITS]
            + [(f"l2a{a}-s{s}", {"splits": s, "ws": True, "ws_variant": {"PIN": True, "L2_AHEAD": a}})
               for a in (1, 2, 4) for s in (1, 2, 4)])


def _kind(name: str) -> str:
    return name[:name.index("-") if "-" in name else len(name.rstrip("0123456789"))]


def case(t: int, valid: int, pool_rows: int):
    slots = torch.full((t, TOPK), -1, dtype=torch.int32, device="cuda")
    slots[:, :valid] = torch.randint(0, pool_rows, (t, valid), device="cuda", dtype=torch.int32)
    qn = torch.randn(t, H, DC, device="cuda", dtype=torch.bfloat16)
    qr = torch.randn(t, H, DR, device="cuda", dtype=torch.bfloat16)
    return slots, qn, qr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sms = num_sms(torch.cuda.current_device())
    rows = []
    torch.manual_seed(0)
    pool_rows = 1 << 21  # 1.4 GB of fp8_ds_mla rows: far past L2, as a decode batch's caches are
    cache = torch.cat([encode_latent(torch.randn(1 << 18, DC + DR, device="cuda"), FP8, DC) for _ in range(8)])
    for valid in VALID:
        for t in BATCHES:
            slots, qn, qr = case(t, valid, pool_rows)
            flop = 2.0 * H * (2 * DC + DR) * t * valid
            out = torch.empty_like(qn)
            ref = G.sparse_mla_attention_gluon(qn, qr, cache, slots, 0.04, out.clone(), {"splits": 1})
            picked = G.launch_plan(qn, qr, cache, slots, 0.04, out, dict(G.DEFAULT), sms)[3][2]
            res = {"tokens": t, "valid": valid, "picked": picked}
            for name, cfg in _configs():
                def call(cfg=cfg, qn=qn, qr=qr, slots=slots, out=out):
                    return G.sparse_mla_attention_gluon(qn, qr, cache, slots, 0.04, out, cfg)
                got = call()
                ms = do_bench(call, warmup=10, rep=50)
                res[name] = {"us": round(ms * 1e3, 1), "tflops": round(flop / ms / 1e9, 1),
                             "max_rel_diff": float((got.float() - ref.float()).abs().max() / ref.float().abs().max())}
            for kind in ("s", "ws", "l2a1", "l2a2", "l2a4"):  # the fastest split of each kernel / variant
                res[f"best_{kind}"] = min((n for n, _ in _configs() if _kind(n) == kind), key=lambda n: res[n]["us"])
            rows.append(res)
            print(f"valid {valid:5d} T={t:4d} picked {picked} best "
                  + " / ".join(res[f"best_{k}"] for k in ("s", "ws", "l2a1", "l2a2", "l2a4")) + ": "
                  + " ".join(f"{n} {res[n]['us']}us/{res[n]['tflops']}TF" for n, _ in _configs()), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sweep_decode_splits.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
