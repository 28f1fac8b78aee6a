"""Sweep of the swap-AB sparse MLA kernel (`kernels/triton_sparse_mla_swap.py`, issue 17) beside the split-K kernel
the registry binds now, at GLM-5.3's shapes (64 heads, kv_lora 512 +
rope 64, top-2048, fp8_ds_mla): does a config win, for decode batches (T=16/32/128 at an 8K context) and prefill
(T=4096 over a 1M-row cache)?

Run on the device (<= 4 min on an H200):  PYTHONPATH=. python bench/sweep_sparse_mla_swap.py --out $OUT
1. compiles every config in parallel worker processes (filling Triton's on-disk cache), reporting the ones that
   fail (e.g. out of shared memory) and going on without them;
2. checks every config against the reference on fp8_ds_mla (split and unsplit top-k, a third of one selection -1),
   and the default on bf16 / fp8_e4m3 / fp32 (relative error < 1e-2);
3. times each as CUDA-graph replays over enough input copies to defeat the L2 (bench_kernels' graph_time),
   printing µs, TFLOP/s, x the split-K kernel, x FlashMLA's published sparse figures (H800: 410 decode, 640
   prefill) and x this run's bf16 GEMM;
4. prints BEST per case, the overall winner (geometric mean) and whether to flip registry.SPARSE_MLA_SWAP_AB;
   and, apart, the split-K kernel's best config per case (`SPLIT_K`: tiles and stages it was never swept at).
"""

from __future__ import annotations

import functools
import json
import math

import torch

from bench import sparse_mla_sweep as SW
from bench.sparse_mla_sweep import CASES, CHECK_LAYOUTS

CHECK_T = (20, 300)  # split top-k (combine kernel) and unsplit
OLD = "split-K (registry now)"
CONFIGS = {  # name: overrides of triton_sparse_mla_swap.DEFAULT (128-key tiles, 8 warps, 1 stage, reload, 64 heads)
    "default": {},
    "keep": {"reload": False},  # the score dot's tiles kept (registers) for the value dot: more spills
    "ns2": {"num_stages": 2},  # Triton's pipeliner: slots one tile ahead, the gathers staged (cp.async)
    "lazy": {"lazy": True},  # O rescaled only when a maximum grew by > 2^8
    "h32": {"block_h": 32},  # half the accumulator registers; each row gathered by two programs
    "h32-ns2": {"block_h": 32, "num_stages": 2},
    "h32-keep": {"block_h": 32, "reload": False},
    "bk64-w4": {"block_k": 64, "num_warps": 4},  # one warpgroup: S not duplicated, O^T 256 registers a thread
    "h32-bk64-w4": {"block_h": 32, "block_k": 64, "num_warps": 4},  # one warpgroup, O^T 128 registers a thread
}
# the split-K kernel the registry binds (`triton_sparse_mla`, 4-group, 64 heads, 8 warps, 32-key tiles, 2 stages):
# the tiles and pipelining its earlier sweeps never tried (bench/RESULTS.md: only 16/32-key tiles at 8 warps)
SPLIT_K = {
    "sk-s1": {"num_stages": 1},
    "sk-s3": {"num_stages": 3},
    "sk-bk64": {"block_k": 64},
    "sk-bk64-s1": {"block_k": 64, "num_stages": 1},
    "sk-w4": {"num_warps": 4},
    "sk-w4-bk64": {"num_warps": 4, "block_k": 64},
    "sk-bk16-s3": {"block_k": 16, "num_stages": 3},
    "sk-generic": {"grouped": False},  # dequantise first, one chained dot over the 576 columns
    "sk-generic-bk64": {"grouped": False, "block_k": 64},
    # each 128-group dequantised apart, S one chained dot, four accumulators: no spills (offline sm_90, Triton 3.6)
    "sk-dq-bk64": {"grouped": "dequant", "block_k": 64},
    "sk-dq-bk64-s1": {"grouped": "dequant", "block_k": 64, "num_stages": 1},
    "sk-dq-bk64-s3": {"grouped": "dequant", "block_k": 64, "num_stages": 3},
    "sk-dq-bk32": {"grouped": "dequant", "block_k": 32},
    "sk-dq-bk64-s1-pf": {"grouped": "dequant", "block_k": 64, "num_stages": 1, "prefetch": True},
}
CONFIGS.update(SPLIT_K)


def _call(name: str, a: tuple, layout: str = "fp8_ds_mla") -> torch.Tensor:
    """One sparse MLA on input set `a`: the split-K kernel (OLD) or a swap config."""
    from dsaserve.kernels import triton_sparse_mla
    from dsaserve.kernels.triton_sparse_mla_swap import sparse_mla_attention_swap

    if name == OLD or name in SPLIT_K:
        return triton_sparse_mla.sparse_mla_attention(a[0], a[1], a[2], layout, a[3], a[4], a[5],
                                                      config=SPLIT_K.get(name))
    return sparse_mla_attention_swap(a[0], a[1], a[2], layout, a[3], a[4], a[5], config=CONFIGS[name])


def precompile(names: list[str], workers: int) -> dict[str, str]:
    # one binary per (config, split or not): T=16 splits the top-k, T=4096 does not (the other T differ only in
    # values Triton does not specialise on); the split-K kernel has a few-token variant too
    jobs = [(n, t, "fp8_ds_mla") for n in [OLD, *names] for t in (16, 4096)] + [(OLD, 1, "fp8_ds_mla")]
    jobs += [("default", t, lay) for lay in CHECK_LAYOUTS[1:] for t in (16, 4096)]
    return SW.precompile(_call, jobs, workers)


def _skip_some(slots: torch.Tensor) -> torch.Tensor:
    """A third of token 0's selection -1 (skipped), as the model's padding and short contexts give."""
    k = slots.shape[1]
    slots[0, k // 3:k // 2] = -1
    return slots


def check(names: list[str]) -> dict[str, float]:
    """Relative error against the reference: each config on fp8_ds_mla, the default on the other layouts."""
    from dsaserve.kernels import reference as R

    errs = {}
    for name, layout in [(n, "fp8_ds_mla") for n in names] + [("default", lay) for lay in CHECK_LAYOUTS[1:]]:
        for t in CHECK_T:
            try:
                qn, qr, cache, slots, scale, dc = SW.inputs(t, layout, rows=50_000)
                slots = _skip_some(slots)
                got = _call(name, (qn, qr, cache, slots, scale, dc), layout)
                ref = R.sparse_mla_attention(qn, qr, cache, layout, slots, scale, dc)
                err = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
            except Exception as ex:  # noqa: BLE001
                print(f"check FAILED {name} {layout} T={t}: {str(ex)[-200:]}", flush=True)
                err = float("inf")
            errs[f"{name} {layout} T={t}"] = err
            print(f"check {name:14s} {layout:10s} T={t:4d} rel err {err:.2e} {'ok' if err < 1e-2 else 'FAIL'}",
                  flush=True)
    return errs


def timings(names: list[str], peak: float) -> list[dict]:
    return SW.timings([(n, functools.partial(_call, n)) for n in [OLD, *names]], peak)


def split_k_summary(rows: list[dict], bad: set[str]) -> dict[str, dict[str, float]]:
    """Per case, the split-K kernel's best config against its registry default (a config to paste into
    `triton_sparse_mla.sparse_mla_attention`'s cfg for that shape class); returns config -> case -> x default."""
    old = {r["case"]: r["TFLOPs"] for r in rows if r["config"] == OLD}
    gains = {n: {r["case"]: r["TFLOPs"] / old[r["case"]] for r in rows if r["config"] == n and r["case"] in old}
             for n in SPLIT_K if n not in bad}
    for case in CASES:
        mine = [r for r in rows if r["case"] == case and r["config"] in SPLIT_K and r["config"] not in bad]
        if mine and case in old:
            b = max(mine, key=lambda r: r["TFLOPs"])
            print(f"SPLIT-K BEST {case:15s} {b['config']:16s} {json.dumps(SPLIT_K[b['config']]):40s} "
                  f"{b['TFLOPs']:7.1f} TFLOP/s = {b['TFLOPs'] / old[case]:.2f} x the registry default")
    return {n: g for n, g in gains.items() if g}


def summary(rows: list[dict], errs: dict[str, float]) -> dict:
    bad = {k.split(" ")[0] for k, v in errs.items() if not v < 1e-2}  # keys: "config layout T=t"
    split_k = split_k_summary(rows, bad)
    ok = [r for r in rows if r["config"] in CONFIGS and r["config"] not in SPLIT_K and r["config"] not in bad]
    old = {r["case"]: r["TFLOPs"] for r in rows if r["config"] == OLD}
    best = {}
    for case in CASES:
        mine = [r for r in ok if r["case"] == case]
        if mine and case in old:
            b = best[case] = max(mine, key=lambda r: r["TFLOPs"])
            print(f"BEST {case:15s} {b['config']:14s} {b['TFLOPs']:7.1f} TFLOP/s ({b['TFLOPs'] / old[case]:.2f} x "
                  f"the split-K kernel's {old[case]:.1f}; {b['vs_flashmla']:.2f} x FlashMLA; "
                  f"{b['vs_bf16_peak']:.2f} x peak)")
    geo = {n: math.exp(sum(math.log(r["TFLOPs"]) for r in ok if r["config"] == n) / len(CASES))
           for n in {r["config"] for r in ok} if sum(r["config"] == n for r in ok) == len(CASES)}
    win = max(geo, key=geo.get) if geo else None
    gains = {r["case"]: r["TFLOPs"] / old[r["case"]] for r in ok if r["config"] == win and r["case"] in old}
    if win:
        print(f"OVERALL (geometric mean over cases): {win} {geo[win]:.1f} TFLOP/s -> DEFAULT overrides "
              f"{json.dumps(CONFIGS[win])}; x the split-K kernel: "
              + ", ".join(f"{c} {g:.2f}" for c, g in gains.items()))
    # DEFAULT is one config for every case, so the winner must beat the split-K kernel in each; the other
    # layouts were checked on "default" only
    flip = len(gains) == len(CASES) and all(g > 1.05 for g in gains.values()) and "default" not in bad
    print(f"FLIP registry.SPARSE_MLA_SWAP_AB: {'yes' if flip else 'no'} (the winner > 1.05 x the split-K kernel in "
          f"every case, all layouts correct)")
    return {"best": best, "gain_vs_split_k": gains, "geomean": geo, "winner": win, "failed_checks": sorted(bad),
            "flip": flip, "split_k_gain": split_k}


def main() -> None:
    SW.main(__doc__, CONFIGS, "sweep_sparse_mla_swap.json", precompile=precompile, check=check, timings=timings,
            summary=summary, only_help="swap configs to sweep")


if __name__ == "__main__":
    main()
