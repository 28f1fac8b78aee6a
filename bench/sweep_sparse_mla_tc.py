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

import functools
import json
import math

from bench import sparse_mla_sweep as SW
from bench.sparse_mla_sweep import CASES, CHECK_LAYOUTS

CHECK_T = (20, 128)  # reference checks: split top-k (and its combine), unsplit
OLD = "split-K kernel (old)"
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


def _call(name: str | None, a: tuple, layout: str = "fp8_ds_mla"):
    """One sparse MLA on input set `a`: the split-K kernel it replaces (name None) or the tc kernel with config
    `name`."""
    from dsaserve.kernels import triton_sparse_mla
    from dsaserve.kernels.triton_sparse_mla_tc import sparse_mla_attention_tc

    if name is None:
        return triton_sparse_mla.sparse_mla_attention(a[0], a[1], a[2], layout, a[3], a[4], a[5])
    return sparse_mla_attention_tc(a[0], a[1], a[2], layout, a[3], a[4], a[5], config=CONFIGS[name])


def precompile(names: list[str], workers: int) -> dict[str, str]:
    jobs = [(n, t, "fp8_ds_mla") for n in [None, *names] for t in CASES.values()]
    jobs += [("default", t, lay) for lay in CHECK_LAYOUTS[1:] for t in CHECK_T]
    return SW.precompile(_call, jobs, workers)


def check(names: list[str]) -> dict[str, float]:
    """Relative error against the reference: each config on fp8_ds_mla, the default on every layout."""
    from dsaserve.kernels import reference as R

    errs = {}
    runs = [(n, "fp8_ds_mla") for n in names] + [("default", lay) for lay in CHECK_LAYOUTS[1:]]
    for name, layout in runs:
        for t in CHECK_T:
            qn, qr, cache, slots, scale, dc = SW.inputs(t, layout, rows=50_000)
            got = _call(name, (qn, qr, cache, slots, scale, dc), layout)
            ref = R.sparse_mla_attention(qn, qr, cache, layout, slots, scale, dc)
            err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            errs[f"{name} {layout} T={t}"] = err
            print(f"check {name:18s} {layout:10s} T={t:4d} rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}",
                  flush=True)
    return errs


def timings(names: list[str], peak: float) -> list[dict]:
    return SW.timings([(OLD, functools.partial(_call, None))] + [(n, functools.partial(_call, n)) for n in names],
                      peak)


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


def main() -> None:
    SW.main(__doc__, CONFIGS, "sweep_sparse_mla_tc.json", precompile=precompile, check=check, timings=timings,
            summary=summary)


if __name__ == "__main__":
    main()
