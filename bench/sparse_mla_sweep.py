"""What the sparse MLA config sweeps share (bench/sweep_sparse_mla_tc.py, bench/sweep_sparse_mla_swap.py): GLM-5.3's
cases and inputs, this run's bf16 ceiling, the parallel precompile, the CUDA-graph timing table and the command
line. Each sweep brings its configs, its kernel call, its reference checks and its verdict.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

CASES = {"decode T=16": 16, "decode T=32": 32, "decode T=128": 128, "prefill T=4096": 4096}
CTX = 8192  # decode context (rows drawn from T x CTX); prefill draws from 1M rows
CHECK_LAYOUTS = ("fp8_ds_mla", "bf16", "fp8_e4m3", "fp32")
FLASHMLA = {"decode": 410.0, "prefill": 640.0}  # TFLOP/s, H800 (FlashMLA README / deep-dive blog)

# a kernel call: (config name, input set from `inputs`, layout) -> output
Call = Callable[[str | None, tuple, str], torch.Tensor]


def inputs(t: int, layout: str = "fp8_ds_mla", rows: int | None = None):
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


def bf16_peak() -> float:
    """This run's dense bf16 rate (8192^3 GEMM), the ceiling the kernel's TFLOP/s are read against."""
    from bench.bench_kernels import graph_time

    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / graph_time([functools.partial(torch.matmul, m, m)], reps=10)


def warm(call: Call, job: tuple[str | None, int, str]) -> tuple[str | None, int, str]:
    """Worker: run one kernel once on one case's shapes with a small cache, so its binary lands in Triton's on-disk
    cache (strides, hence the specialisation, are the timed run's)."""
    name, t, layout = job
    try:
        call(name, inputs(t, layout, rows=4096), layout)
        torch.cuda.synchronize()
        return name, t, ""
    except Exception as ex:  # noqa: BLE001 - report, the sweep goes on without this config
        return name, t, f"{type(ex).__name__}: {str(ex)[-300:]}"


def precompile(call: Call, jobs: list[tuple[str | None, int, str]], workers: int) -> dict[str, str]:
    """Run the (config, T, layout) jobs in spawned worker processes (`warm`); the configs that failed, with why.
    `call` must be a module-level function, so the workers can unpickle it."""
    failed = {}
    with mp.get_context("spawn").Pool(min(workers, len(jobs))) as pool:
        for name, t, err in pool.imap_unordered(functools.partial(warm, call), jobs):
            if err:
                failed[str(name)] = err
                print(f"compile/run FAILED {name} T={t}: {err}", flush=True)
    return failed


def timings(kinds: list[tuple[str, Callable[[tuple], torch.Tensor]]], peak: float) -> list[dict]:
    """Each (label, call on an input set) per case as CUDA-graph replays over enough input copies to defeat the
    L2 (bench_kernels' graph_time): a row and a printed line each; a kind that fails is reported and skipped."""
    from bench.bench_kernels import copies_for, graph_time

    rows = []
    for case, t in CASES.items():
        copies = copies_for(t * 2048 * 656, cap=16) if t < 1024 else 1
        sets = [inputs(t) for _ in range(copies)]
        flops = 2.0 * t * 64 * 2048 * (2 * 512 + 64)
        for label, call in kinds:
            try:
                sec = graph_time([functools.partial(call, a) for a in sets], reps=5 if t >= 1024 else 20)
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


def main(doc: str, configs: dict[str, dict], json_name: str, *, precompile: Callable[[list[str], int], dict],
         check: Callable[[list[str]], dict], timings: Callable[[list[str], float], list],
         summary: Callable[[list[dict], dict], dict], only_help: str = "configs to sweep") -> None:
    """A sweep's command line (--out, --workers, --only) and run: precompile the chosen configs, check the ones
    that compiled, time them, summarise, and write everything to --out/json_name (what was measured is kept
    when a later step fails)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--only", default=",".join(configs), help=only_help)
    args = ap.parse_args()
    for name in args.only.split(","):
        if name not in configs:
            raise SystemExit(f"--only: unknown config {name!r}; known: {', '.join(configs)}")
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
    (args.out / json_name).write_text(json.dumps(result, indent=1, default=str))
