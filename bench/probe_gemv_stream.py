"""How fast the batch-1 FP8 GEMV streams its weight against the pure-read ceiling, by tile (issue 17).

The b1 step's skinny GEMMs read their weights at ~0.77-0.8 of the pure-read ceiling (bench/RESULTS.md, nineteenth
and twentieth sessions: 1.61 GB in 477 µs on an H200; o_proj at 3.42 TB/s), where lm_head's cuBLAS reads at the
ceiling. A skinny program reads its [block_n rows x 128 B] tile a K step: 128 contiguous bytes of each row, the
rows 16 KB apart at o_proj. This probe asks what the access pattern alone reaches and what each tile does:
  read   a pure-read Triton kernel over the same [N, K] e4m3 weight in [BN, BK] tiles along K (no arithmetic but a
         byte sum), BK 128-1024;
  gemv   `triton_fp8_gemm.skinny_gemm` at 1-2 rows, block_n, stages and splits around the shipped config; each
         output at the shipped split against the shipped config's (`same`: bit for bit; another block_n may pick
         another MMA shape, so its sums may part in the last bits).
H100 (forty-third session, bench/RESULTS.md): the shipped tiles at 0.47-0.88 of the read ceiling (the small
projections lowest: their ramp); the best tile at o_proj, gate_up and wq_b, 1.11x slower than the best at q_b (4
stages) and qkv_a (32 rows, 4 stages), 4.5 % at dense down (split 4); the pure-read kernel slower than the GEMV, and
more contiguous bytes a row a step did not help (`bench/attempts/skinny_ksub.patch`).
Every case is a CUDA graph over copies of the weight (over 200 MB: from HBM, not L2); TB/s over the same run's
pure-read ceiling (`torch.sum`).

Run on the device:  PYTHONPATH=. python bench/probe_gemv_stream.py --out $OUT [--rows 1,2] [--shapes o_proj,...]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.bench_kernels import graph_time, probe_start
from bench.probe_scaled_mm_rows import weight_copies

# (name, N, K): the slice's b1 GEMVs (qkv_a: q_a 2048 + kv_a 576 padded to 640 + wk 128)
SHAPES = [("qkv_a", 2816, 6144), ("q_b", 16384, 2048), ("idx_wq_b", 4096, 2048), ("o_proj", 6144, 16384),
          ("dense gate_up", 24576, 6144), ("dense down", 6144, 12288)]
READ_SHAPES = ("qkv_a", "o_proj", "dense gate_up")  # the pure-read sweep's shapes (the GEMV's: all)


@triton.jit
def _read_kernel(w_ptr, out_ptr, N, K, kb_per_split, stride_n, BN: tl.constexpr, BK: tl.constexpr):
    """Sum a [BN, kb_per_split * BK] slab of the weight's bytes along K: the skinny GEMV's reads without its MMA."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    ptrs = w_ptr + rows[:, None] * stride_n + pid_s * kb_per_split * BK + tl.arange(0, BK)[None, :]
    acc = tl.zeros([BN, BK], dtype=tl.int32)
    for i in range(0, kb_per_split):
        acc += tl.load(ptrs + i * BK, mask=rows[:, None] < N, other=0).to(tl.int32)
    tl.store(out_ptr + pid_s * N + rows, tl.sum(acc, axis=1), mask=rows < N)


def read_cases(rows: list[dict], shape: tuple, ws: list, nbytes: int, ceil: float) -> None:
    name, n, k = shape
    out = torch.empty(16, n, dtype=torch.int32, device="cuda")
    for bn, bk, stages, split in itertools.product((32, 64), (128, 256, 512, 1024), (3, 4, 6), (1, 2)):
        if k % (bk * split) or stages * bn * bk > 160 * 1024:
            continue
        kbs = k // bk // split
        def run(w, bn=bn, bk=bk, stages=stages, split=split, kbs=kbs):  # noqa: E306
            _read_kernel[(triton.cdiv(n, bn), split)](w.view(torch.uint8), out, n, k, kbs, w.stride(0), BN=bn,
                                                      BK=bk, num_warps=4, num_stages=stages)
        t = graph_time([functools.partial(run, w) for w, _ in ws])
        rows.append({"kind": "read", "shape": name, "bn": bn, "bk": bk, "stages": stages, "split": split,
                     "us": t * 1e6, "tb_s": n * k / t / 1e12, "of_read": n * k / t / ceil})
        print(f"read {name:14s} bn {bn:3d} bk {bk:5d} st {stages} split {split}: {t * 1e6:7.2f} us "
              f"{n * k / t / 1e12:.2f} TB/s ({n * k / t / ceil:.2f} of read)", flush=True)


def gemv_cases(rows: list[dict], shape: tuple, ws: list, nbytes: int, ceil: float, ms: list[int]) -> None:
    from dsaserve.kernels import triton_fp8_gemm as G

    name, n, k = shape
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        act = G.quant_act_fp8(x)
        ship = G.skinny_config(m, n, k, G._sm_count(x))
        want = G.skinny_gemm(x, *ws[0], out_dtype=torch.bfloat16, act=act, **ship).float()
        t_lin = graph_time([functools.partial(G.fp8_linear, x, w, s) for w, s in ws])  # + the quantiser
        t_ship = graph_time([functools.partial(G.skinny_gemm, x, w, s, out_dtype=torch.bfloat16, act=act, **ship)
                             for w, s in ws])
        print(f"gemv {name:14s} m {m}: shipped tile {ship} {t_ship * 1e6:7.2f} us {nbytes / t_ship / 1e12:.2f} TB/s "
              f"({nbytes / t_ship / ceil:.2f} of read); fp8_linear from bf16 rows {t_lin * 1e6:7.2f} us", flush=True)
        rows.append({"kind": "shipped", "shape": name, "m": m, "us": t_ship * 1e6, "of_read": nbytes / t_ship / ceil,
                     "fp8_linear_us": t_lin * 1e6})
        splits = sorted({1, 2, 4, 8, ship["split"]})
        best = None
        for bn, stages, split in itertools.product((32, 64), (3, 4, 6), splits):
            if (k // 128) % split:
                continue
            conf = dict(ship, block_n=bn, num_stages=stages, split=split)
            run = functools.partial(G.skinny_gemm, x, out_dtype=torch.bfloat16, act=act, **conf)
            try:
                same = bool(torch.equal(run(*ws[0]).float(), want)) if split == ship["split"] else None
                t = graph_time([functools.partial(run, w, s) for w, s in ws])
            except Exception as e:  # noqa: BLE001 - a config past shared memory is a data point
                print(f"gemv {name} m {m} bn {bn} st {stages} split {split}: {type(e).__name__}")
                continue
            row = {"kind": "gemv", "shape": name, "m": m, "bn": bn, "stages": stages, "split": split,
                   "us": t * 1e6, "tb_s": nbytes / t / 1e12, "of_read": nbytes / t / ceil, "same": same,
                   "vs_shipped": t_ship / t}
            rows.append(row)
            best = row if best is None or t * 1e6 < best["us"] else best
            print(f"gemv {name:14s} m {m} bn {bn:3d} st {stages} split {split:2d}: {t * 1e6:7.2f} us "
                  f"{nbytes / t / 1e12:.2f} TB/s ({nbytes / t / ceil:.2f} of read, {t_ship / t:.3f}x shipped)"
                  f"{'' if same is None else f' same {same}'}", flush=True)
        if best:
            print(f"BEST gemv {name} m {m}: {best}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rows", default="1")
    ap.add_argument("--shapes", default="", help="by name, comma-separated (default: all)")
    ap.add_argument("--skip-read", action="store_true")
    args = ap.parse_args()
    ceilings = probe_start(args.out)
    rows: list[dict] = []
    wanted = set(args.shapes.split(",")) if args.shapes else None
    for shape in (s for s in SHAPES if wanted is None or s[0] in wanted):
        ws, nbytes = weight_copies(shape[1], shape[2])
        if not args.skip_read and shape[0] in READ_SHAPES:
            read_cases(rows, shape, ws, nbytes, ceilings["read_Bps"])
        gemv_cases(rows, shape, ws, nbytes, ceilings["read_Bps"], [int(v) for v in args.rows.split(",")])
        del ws
        (args.out / "probe_gemv_stream.json").write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
