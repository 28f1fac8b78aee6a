"""Config sweep of the tensor-core sparse MLA kernel (`kernels/triton_sparse_mla_tc.py`, issue 17) at GLM-5.3's
shapes (64 heads, kv_lora 512 + rope 64, top-2048, fp8_ds_mla): which config wins for decode batches and prefill.

Run on the device (<= 3 min on an H200):  PYTHONPATH=. python bench/sweep_sparse_mla_tc.py --out $OUT
1. compiles every config in parallel worker processes (they fill Triton's on-disk cache; the timing process then
   loads the binaries), reporting configs that fail to compile (e.g. shared memory);
2. checks each config, and the default on all four KV layouts, against the reference (relative error < 1e-2);
3. times each config as CUDA-graph replays over enough input copies to defeat the L2 (decode T=16/32/128 at an 8K
   context, prefill T=4096 over a 1M-row cache: random rows, the worst case), beside the split-K kernel it
   replaces, FlashMLA's published sparse figures (H800: 410 TFLOP/s decode, 640 prefill) and this run's bf16 GEMM;
4. prints BEST per case and the config best over all cases (geometric mean) as a DEFAULT to paste.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import multiprocessing as mp
import traceback
from pathlib import Path

import torch

CASES = {"decode T=16": 16, "decode T=32": 32, "decode T=128": 128, "prefill T=4096": 4096}
CTX = 8192  # decode context (rows drawn from T x CTX); prefill draws from 1M rows
CHECK_T = (20, 128)  # reference checks: split top-k (and its combine), unsplit
CHECK_LAYOUTS = ("fp8_ds_mla", "bf16", "fp8_e4m3", "fp32")
FLASHMLA = {"decode": 410.0, "prefill": 640.0}  # TFLOP/s, H800 (FlashMLA README / deep-dive blog)
CONFIGS = {  # name: overrides of triton_sparse_mla_tc.DEFAULT (4 warps, 32-key tiles, dv_split 2, bits, prefetch)
    "default": {},
    "no-prefetch": {"prefetch": False},
    "cvt-decode": {"bits": False},
    "pipeliner-ns2": {"prefetch": False, "num_stages": 2},  # Triton stages the gathers in shared memory
    "w4-bk16": {"block_k": 16},  # smaller tiles: two programs a SM even if the compiler takes more memory
    "w4-bk64": {"block_k": 64},  # S as m64n64 (balanced shared-memory reads), one program a SM
    "w8-bk32-dv2": {"num_warps": 8},
    "w8-bk64-dv1": {"num_warps": 8, "block_k": 64, "dv_split": 1},  # one program a token (S runs twice in it)
}


def _inputs(t: int, layout: str = "fp8_ds_mla", rows: int | None = None):
    """(q_nope, q_rope, cache, top-k slots, softmax scale, kv_lora) at glm-5.3-slice's shapes; every slot valid,
    drawn at random from `rows` cache rows (default T x CTX, at most 1M: 656 MB)."""
    from dsaserve.common.kv_layout import encode_latent
    from dsaserve.config import load_config

    cfg = load_config("glm-5.3-slice")
    h, dc, dr, topk = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_topk
    rows = rows or min(t * CTX, 1 << 20)
    cache = encode_latent(torch.randn(rows, dc + dr, device="cuda"), layout, dc)
    slots = torch.randint(0, rows, (t, topk), device="cuda")
    qn = torch.randn(t, h, dc, device="cuda", dtype=torch.bfloat16)
    qr = torch.randn(t, h, dr, device="cuda", dtype=torch.bfloat16)
    return qn, qr, cache, slots, cfg.qk_head_dim ** -0.5, dc


def _warm(job: tuple[str | None, int, str]) -> tuple[str | None, int, str]:
    """Worker: run one config (None: the split-K kernel) once on one case's shapes with a small cache, so its
    binary lands in Triton's on-disk cache (the strides, hence the specialisation, are the timed run's)."""
    name, t, layout = job
    try:
        qn, qr, cache, slots, scale, dc = _inputs(t, layout, rows=4096)
        _call(None if name is None else CONFIGS[name], (qn, qr, cache, slots, scale, dc), layout)
        torch.cuda.synchronize()
        return name, t, ""
    except Exception as ex:  # noqa: BLE001 - report, the sweep goes on without this config
        return name, t, f"{type(ex).__name__}: {str(ex)[-300:]}"


def precompile(names: list[str], workers: int) -> dict[str, str]:
    jobs = [(n, t, "fp8_ds_mla") for n in [None, *names] for t in CASES.values()]
    jobs += [("default", t, lay) for lay in CHECK_LAYOUTS[1:] for t in CHECK_T]
    failed = {}
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        for name, t, err in pool.imap_unordered(_warm, jobs):
            if err:
                failed[str(name)] = err
                print(f"compile/run FAILED {name} T={t}: {err}", flush=True)
    return failed


def check(names: list[str]) -> dict[str, float]:
    """Relative error against the reference: each config on fp8_ds_mla, the default on every layout."""
    from dsaserve.kernels import reference as R

    errs = {}
    runs = [(n, "fp8_ds_mla") for n in names] + [("default", lay) for lay in CHECK_LAYOUTS[1:]]
    for name, layout in runs:
        for t in CHECK_T:
            qn, qr, cache, slots, scale, dc = _inputs(t, layout, rows=50_000)
            got = _call(CONFIGS[name], (qn, qr, cache, slots, scale, dc), layout)
            ref = R.sparse_mla_attention(qn, qr, cache, layout, slots, scale, dc)
            err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            errs[f"{name} {layout} T={t}"] = err
            print(f"check {name:18s} {layout:10s} T={t:4d} rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}",
                  flush=True)
    return errs


def _call(conf: dict | None, a: tuple, layout: str = "fp8_ds_mla") -> torch.Tensor:
    """One sparse MLA on input set `a`: the split-K kernel it replaces (conf None) or the tc kernel with conf."""
    from dsaserve.kernels import triton_sparse_mla as OLD
    from dsaserve.kernels.triton_sparse_mla_tc import sparse_mla_attention_tc

    if conf is None:
        return OLD.sparse_mla_attention(a[0], a[1], a[2], layout, a[3], a[4], a[5])
    return sparse_mla_attention_tc(a[0], a[1], a[2], layout, a[3], a[4], a[5], config=conf)


def timings(names: list[str], peak: float) -> list[dict]:
    from bench.bench_kernels import copies_for, graph_time

    rows = []
    for case, t in CASES.items():
        copies = copies_for(t * 2048 * 656, cap=16) if t < 1024 else 1
        sets = [_inputs(t) for _ in range(copies)]
        flops = 2.0 * t * 64 * 2048 * (2 * 512 + 64)
        kinds = [("split-K kernel (old)", None)] + [(n, CONFIGS[n]) for n in names]
        for label, conf in kinds:
            try:
                sec = graph_time([functools.partial(_call, conf, a) for a in sets], reps=5 if t >= 1024 else 20)
            except Exception as ex:  # noqa: BLE001
                print(f"time FAILED {label} {case}: {str(ex)[-200:]}", flush=True)
                continue
            tf = flops / sec / 1e12
            ref = FLASHMLA["prefill" if t >= 1024 else "decode"]
            rows.append({"case": case, "config": label, "us": sec * 1e6, "TFLOPs": tf, "vs_flashmla": tf / ref,
                         "vs_bf16_peak": tf * 1e12 / peak})
            print(f"{case:15s} {label:22s} {sec * 1e6:9.1f} us {tf:7.1f} TFLOP/s  {tf / ref:5.2f} x FlashMLA(H800 "
                  f"{ref:.0f})  {tf * 1e12 / peak:5.2f} x bf16 peak", flush=True)
        del sets
        torch.cuda.empty_cache()
    return rows


def summary(rows: list[dict], errs: dict[str, float]) -> dict:
    bad = {k.split()[0] for k, v in errs.items() if not v < 1e-2}
    ok = [r for r in rows if r["config"] in CONFIGS and r["config"] not in bad]
    best = {}
    for case in CASES:
        mine = [r for r in ok if r["case"] == case]
        old = [r for r in rows if r["case"] == case and r["config"] not in CONFIGS]
        if mine:
            b = max(mine, key=lambda r: r["TFLOPs"])
            best[case] = b
            base = old[0]["TFLOPs"] if old else float("nan")
            print(f"BEST {case:15s} {b['config']:18s} {b['TFLOPs']:7.1f} TFLOP/s ({b['TFLOPs'] / base:.2f} x the "
                  f"split-K kernel's {base:.1f}; {b['vs_flashmla']:.2f} x FlashMLA; {b['vs_bf16_peak']:.2f} x peak)")
    names = {r["config"] for r in ok}
    geo = {n: math.exp(sum(math.log(r["TFLOPs"]) for r in ok if r["config"] == n) / len(CASES))
           for n in names if sum(r["config"] == n for r in ok) == len(CASES)}
    if geo:
        win = max(geo, key=geo.get)
        print(f"OVERALL (geometric mean over cases): {win} {geo[win]:.1f} TFLOP/s -> DEFAULT overrides "
              f"{json.dumps(CONFIGS[win])}")
    t16 = [r for r in rows if r["case"] == "decode T=16"]
    if t16:
        fastest = max(t16, key=lambda r: r["TFLOPs"])["config"]
        print(f"T=16: fastest is {fastest!r} (TC_MIN_TOKENS=16 is right if it is not the split-K kernel)")
    return {"best": best, "geomean": geo, "failed_checks": sorted(bad)}


def bf16_peak() -> float:
    """This run's dense bf16 rate (8192^3 GEMM), the ceiling the kernel's TFLOP/s are read against."""
    from bench.bench_kernels import graph_time

    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / graph_time([functools.partial(torch.matmul, m, m)], reps=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--only", default=",".join(CONFIGS), help="configs to sweep")
    args = ap.parse_args()
    for name in args.only.split(","):
        if name not in CONFIGS:
            raise SystemExit(f"--only: unknown config {name!r}; known: {', '.join(CONFIGS)}")
    failed = precompile(args.only.split(","), args.workers)
    names = [n for n in args.only.split(",") if n not in failed]
    torch.manual_seed(0)
    peak = bf16_peak()
    print(f"bf16 GEMM 8192^3: {peak / 1e12:.0f} TFLOP/s; {torch.cuda.get_device_name()}", flush=True)
    errs, rows = {}, []
    try:
        errs = check(names)
        rows = timings(names, peak)
    except Exception:  # noqa: BLE001 - keep what was measured
        traceback.print_exc()
    result = {"peak_bf16": peak, "compile_failed": failed, "errors": errs, "rows": rows,
              "summary": summary(rows, errs) if rows else {}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep_sparse_mla_tc.json").write_text(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
