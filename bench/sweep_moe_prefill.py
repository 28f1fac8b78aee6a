"""Sweep of the fused MoE prefill path (issue 17): the dense grouped FP8 GEMMs of `triton_moe_prefill` over
their tilings, beside the gather kernel they replace and the cuBLAS expert GEMMs (`cublas_moe_prefill`,
variant "cublas"), on glm-5.3-slice's MoE shapes (32 experts, H 6144, I 2048, top-8) at T = 4096 / 8192 /
16384 tokens, uniform and skewed routing.

Run on the device:  PYTHONPATH=. python bench/sweep_moe_prefill.py --out $OUT      (~3 min on an H200)
Every variant is compiled first, in parallel worker processes (Triton's disk cache carries the binaries to
this process); a variant that fails to compile or run is printed and skipped. Each row: median of event-timed
calls, TFLOP/s (6 T k H I flops a call: GEMM1 4 T k H I, GEMM2 2 T k H I), the ratio to `torch._scaled_mm`'s
FP8 8192^3 rate measured in the same run, and the relative error against `reference.fused_moe` (bound 6e-2:
activations quantised per (token, 128)). "skewed" routing: fixed per-expert logit offsets (a few experts
take several times the mean, expert 0 takes none). Then the stages of the best variant at T=4096 one by one:
the expert sort (old torch version beside `triton_moe_align`), both permutes ("token": each token quantised
once and copied to its k rows; "slot": one program a row, x read k times) with their HBM byte floors at
4.25 TB/s, GEMM1, GEMM2, the combine, the whole call. Last lines: the fastest variant per T, the worst error
per accumulation mode, and the new default (fastest summed over all rows, correct in all). --host first
measures the cuBLAS path's host cost an expert GEMM (what sets its `cublas_min_rows`); a cuBLAS variant's
stages are its own (permute into per-expert scale blocks, the expert GEMMs, SiLU*up + quantise).
Writes sweep_moe_prefill.json and .md under --out.
Without a GPU:  --offline  compiles each variant's GEMM kernels for sm_90 and prints registers, spills and
shared memory (Triton's ptxas); --tiny  runs the whole sweep under TRITON_INTERPRET=1 at toy shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

FP8A = 6e-2
# name -> fused_moe config ("dense" keys: triton_moe_prefill.PREFILL_CONFIG; "gemm": the gather kernel)
CONFIGS: dict[str, dict] = {
    "gather-64x64 (old)": {"kernel": "gemm", "block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 4},
    "d128 promote (default)": {"kernel": "dense", "gemm": "triton"},
    "cublas": {"kernel": "dense", "gemm": "cublas"},
    "d128 promote slot-permute (old)": {"kernel": "dense", "permute": "slot"},
    "d128 lag2": {"kernel": "dense", "lag2": True},
    "d128 lag2 s3": {"kernel": "dense", "lag2": True, "stages2": 3},
    "d128 mma_acc": {"kernel": "dense", "mma_acc": True},
    "d128 mma_acc1": {"kernel": "dense", "mma_acc1": True},
    "d128 mma_acc2": {"kernel": "dense", "mma_acc2": True},
    "d128 pair2 mma_acc2": {"kernel": "dense", "pair_n2": True, "mma_acc2": True},
    "d128 pair2 mma_acc2 s3": {"kernel": "dense", "pair_n2": True, "mma_acc2": True, "stages2": 3},
    "d128 pair2 promote (spills)": {"kernel": "dense", "pair_n2": True},
    "d128 persistent2 flatten2": {"kernel": "dense", "persistent2": True, "flatten2": True},
    "d128 persistent2 flatten2 lag2": {"kernel": "dense", "persistent2": True, "flatten2": True, "lag2": True},
    "d128 persistent": {"kernel": "dense", "persistent": True},
    "d128 g16": {"kernel": "dense", "group_m": 16},
}
SHAPE = {"slice": (32, 6144, 2048, 8), "tiny": (4, 256, 128, 2)}  # E, H, I, top-k


def make_weights(e: int, h: int, inter: int, dev: str, seed: int = 0):
    from dsaserve.weights.fp8 import quantize_fp8_block

    g = torch.Generator(device=dev).manual_seed(seed)
    w13, s13 = quantize_fp8_block(torch.randn(e, 2 * inter, h, device=dev, generator=g) * 0.05)
    w2, s2 = quantize_fp8_block(torch.randn(e, h, inter, device=dev, generator=g) * 0.05)
    return w13, s13, w2, s2


def make_batch(t: int, e: int, h: int, k: int, dist: str, dev: str, seed: int = 1):
    """x [T, H] bf16 and (weights, ids) of moe_route; "skewed": per-expert logit offsets, expert 0 never chosen."""
    from dsaserve.kernels import reference as R

    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(t, h, device=dev, generator=g).bfloat16()
    logits = torch.randn(t, e, device=dev, generator=g)
    if dist == "skewed":
        offset = torch.linspace(2.5, -1.0, e, device=dev)  # sigmoid scores: early experts chosen far more often
        logits = logits + offset[torch.randperm(e, device=dev, generator=g)]
        logits[:, 0] = -1e4
    tw, ids = R.moe_route(logits, torch.zeros(e, device=dev), k, 1, 1, 2.5, True)
    return x, tw, ids


def run_variant(conf: dict, x, w, tw, ids):
    from dsaserve.kernels import triton_moe as MOE

    return MOE.fused_moe(x, *w[:2], *w[2:], tw, ids, config=conf)


def _compile_worker(name: str, shape: tuple) -> tuple[str, str]:
    """Compile one variant by running it at a small T on the sweep's shapes (fills Triton's disk cache)."""
    try:
        e, h, inter, k = shape
        w = make_weights(min(e, 8), h, inter, "cuda")
        x, tw, ids = make_batch(512, min(e, 8), h, k, "uniform", "cuda")
        run_variant(CONFIGS[name], x, w, tw, ids)
        torch.cuda.synchronize()
        return name, "ok"
    except Exception as ex:  # noqa: BLE001 - a variant that does not compile is a result
        return name, f"FAILED {type(ex).__name__}: {str(ex)[:300]}"


def precompile(names: list[str], shape: tuple, workers: int) -> dict[str, str]:
    import multiprocessing as mp

    t0 = time.time()
    with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as pool:
        status = dict(pool.map(_compile_worker, names, [shape] * len(names)))
    for name, s in status.items():
        if s != "ok":
            print(f"compile {name}: {s}", flush=True)
    print(f"precompiled {len(names)} variants in {time.time() - t0:.0f} s", flush=True)
    return status


def event_time(fn, reps: int) -> float:
    """Median seconds of fn() over `reps` CUDA-event-timed runs after one warm-up run."""
    from bench.bench_gpu import cuda_time  # imported here: bench_gpu imports the engine, the workers need not

    return cuda_time(fn, iters=reps, warmup=1)


def fp8_peak() -> float:
    m = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    k = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    sec = event_time(lambda: torch._scaled_mm(m, k, one, one, out_dtype=torch.bfloat16), 20)
    return 2 * 8192**3 / sec


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def sweep(names, tokens, dists, shape, dev, reps, peak) -> list[dict]:
    from dsaserve.kernels import reference as R

    e, h, inter, k = shape
    w = make_weights(e, h, inter, dev)
    rows = []
    for t in tokens:
        for dist in dists:
            x, tw, ids = make_batch(t, e, h, k, dist, dev)
            counts = torch.bincount(ids.reshape(-1), minlength=e)
            ref = R.fused_moe(x, *w[:2], *w[2:], tw, ids)
            flops = 6.0 * t * k * h * inter
            print(f"-- T={t} {dist}: tokens per expert min {int(counts.min())} max {int(counts.max())} "
                  f"mean {t * k / e:.0f}", flush=True)
            for name in names:
                r = {"T": t, "dist": dist, "variant": name, "config": CONFIGS[name]}
                try:
                    err = rel(run_variant(CONFIGS[name], x, w, tw, ids), ref)
                    call = (lambda c=CONFIGS[name], b=(x, w, tw, ids): run_variant(c, *b))
                    sec = event_time(call, reps) if dev == "cuda" else float("nan")
                    r.update(us=sec * 1e6, tflops=flops / sec / 1e12, ratio=flops / sec / peak, rel_err=err,
                             ok=err < FP8A)
                except Exception as ex:  # noqa: BLE001 - one failing variant must not stop the sweep
                    r.update(error=f"{type(ex).__name__}: {str(ex)[:300]}")
                print(row_text(r), flush=True)
                rows.append(r)
    return rows


def row_text(r: dict) -> str:
    head = f"T={r['T']:<6d} {r['dist']:8s} {r['variant']:30s}"
    if "error" in r:
        return f"{head} FAILED {r['error']}"
    return (f"{head} {r['us']:9.1f} us {r['tflops']:7.1f} TF/s  ratio {r['ratio']:.3f}  rel {r['rel_err']:.4f}"
            f" {'ok' if r['ok'] else 'WRONG'}")


HBM = 4.25e12  # H200 HBM3e bytes/s (spec): the floor of the memory-bound stages


def stage_bytes(t: int, k: int, h: int, rows_pad: int) -> dict[str, float]:
    """HBM bytes each data-movement stage must move at least (no L2 reuse of x assumed for "slot", whose
    k reads of a token fall in k different expert runs): x bf16 in, e4m3 rows + fp32 scales out."""
    kg = -(-h // 128)
    return {"permute token": t * h * 2 + t * k * (h + 4 * kg) + t * k * 4,
            "permute slot": t * k * h * 2 + rows_pad * (h + 4 * kg) + rows_pad * 4 + t * k * 4,
            "combine": t * k * h * 2 + t * h * 2 + t * k * 8}


def stage_breakdown(name: str, shape: tuple, t: int, reps: int, peak: float, dev: str = "cuda") -> list[dict]:
    """Time the stages of one dense variant on their own: the old torch align beside the Triton one, both
    permutes (with their byte floors at HBM speed), GEMM1, GEMM2, the combine, and the whole call."""
    from dsaserve.kernels import triton_moe_align as A
    from dsaserve.kernels import triton_moe_prefill as P

    e, h, inter, k = shape
    w13, s13, w2, s2 = make_weights(e, h, inter, dev)
    x, tw, ids = make_batch(t, e, h, k, "uniform", dev)
    cfg = {**P.PREFILL_CONFIG, **CONFIGS[name]}
    route = A.align_route(ids, e, cfg["block_m"])
    a1, a1_s, pos = P.permute_quant(x, route, k)
    rows_pad = a1.shape[0]
    fused = cfg["bn1"] == 128
    act = torch.empty(rows_pad, inter, dtype=torch.float8_e4m3fn if fused else torch.bfloat16, device=dev)
    act_s = torch.ones(-(-inter // 128), rows_pad, device=dev) if fused else None
    act8 = torch.zeros(rows_pad, inter, dtype=torch.float8_e4m3fn, device=dev)
    act8_s = torch.ones(-(-inter // 128), rows_pad, device=dev)
    out = torch.zeros(rows_pad, h, dtype=torch.bfloat16, device=dev)
    nbytes = stage_bytes(t, k, h, rows_pad)
    fl = 2.0 * t * k * h * inter
    stages = {
        "align torch (old)": (lambda: A.moe_align_torch(ids, e, cfg["block_m"]), 0.0),
        "align triton": (lambda: A.align_route(ids, e, cfg["block_m"]), 0.0),
        "permute token": (lambda: P.permute_quant(x, route, k, "token"), 0.0),
        "permute slot": (lambda: P.permute_quant(x, route, k, "slot"), 0.0),
        "gemm1": (lambda: P.grouped_gemm(a1, a1_s, w13, s13, act, act_s, route, inter, True, cfg, 1), 2 * fl),
        "gemm2": (lambda: P.grouped_gemm(act8, act8_s, w2, s2, out, None, route, h, False, cfg, 2), fl),
        "combine": (lambda: P.unpermute_combine(out, pos, tw, None, x.dtype), 0.0),
        "whole": (lambda: run_variant(CONFIGS[name], x, (w13, s13, w2, s2), tw, ids), 3 * fl),
    }
    return time_stages(stages, nbytes, name, t, reps, peak, dev)


def time_stages(stages: dict, nbytes: dict, name: str, t: int, reps: int, peak: float, dev: str) -> list[dict]:
    """Each stage (name -> (call, FLOPs)) timed on its own, printed and returned as rows (a failing one printed)."""
    rows = []
    for stage, (fn, flops) in stages.items():
        try:
            sec = event_time(fn, reps) if dev == "cuda" else _run_once(fn)
            r = {"stage": stage, "variant": name, "T": t, "us": sec * 1e6, "tflops": flops / sec / 1e12,
                 "ratio": flops / sec / peak, "bytes": nbytes.get(stage, 0)}
            rows.append(r)
            print(stage_text(r), flush=True)
        except Exception as ex:  # noqa: BLE001
            print(f"stage {stage} FAILED {ex!r}"[:300], flush=True)
    return rows


def cublas_stage_breakdown(name: str, shape: tuple, t: int, reps: int, peak: float) -> list[dict]:
    """The stages of a cuBLAS variant (`cublas_moe_prefill`) on their own: align, the permute into per-expert
    scale blocks, GEMM1 and GEMM2 (one _scaled_mm an expert, host launches included), SiLU*up + quantise, the
    combine, and the whole call with its host wait."""
    from dsaserve.kernels import cublas_moe_prefill as C
    from dsaserve.kernels import triton_moe_align as A
    from dsaserve.kernels import triton_moe_prefill as P

    e, h, inter, k = shape
    w13, s13, w2, s2 = make_weights(e, h, inter, "cuda")
    x, tw, ids = make_batch(t, e, h, k, "uniform", "cuda")
    cfg = {**P.PREFILL_CONFIG, **CONFIGS[name]}
    bm = cfg["block_m"]
    route = A.align_route(ids, e, bm)
    a1, a1_s = C.quant_scatter_segments(x, route, k, bm)
    runs = C.expert_runs(*C.run_bounds(route[4]))
    rows_pad = a1.shape[0]
    h13 = torch.empty(rows_pad, 2 * inter, dtype=torch.bfloat16, device="cuda")
    act, act_s = C.silu_mul_quant_segments(h13.zero_(), route, bm)
    out = torch.empty(rows_pad, h, dtype=torch.bfloat16, device="cuda")
    fl = 2.0 * t * k * h * inter
    stages = {
        "align triton": (lambda: A.align_route(ids, e, bm), 0.0),
        "permute segments": (lambda: C.quant_scatter_segments(x, route, k, bm), 0.0),
        "gemm1 cublas": (lambda: C.expert_gemms(a1, a1_s, w13, s13, h13, runs), 2 * fl),
        "silu quant": (lambda: C.silu_mul_quant_segments(h13, route, bm), 0.0),
        "gemm2 cublas": (lambda: C.expert_gemms(act, act_s, w2, s2, out, runs), fl),
        "combine": (lambda: P.unpermute_combine(out, route[3], tw, None, x.dtype), 0.0),
        "whole": (lambda: run_variant(CONFIGS[name], x, (w13, s13, w2, s2), tw, ids), 3 * fl),
    }
    floors = stage_bytes(t, k, h, rows_pad)
    nbytes = {"permute segments": floors["permute token"], "combine": floors["combine"],
              "silu quant": t * k * (2 * inter * 2 + inter + 4 * inter // 128)}
    return time_stages(stages, nbytes, name, t, reps, peak, "cuda")


def host_costs(shape: tuple, rows: int = 128, reps: int = 20) -> dict[str, float]:
    """Host µs an expert GEMM of the cuBLAS path costs (GEMM1's shapes, `rows` rows an expert so the GPU keeps
    up): building its operand views, `torch._scaled_mm` on prebuilt operands, and `expert_gemms` (both), each
    timed over one layer's experts between syncs; and the GPU µs of one such call, for comparison."""
    from dsaserve.kernels import cublas_moe_prefill as C

    e, h, inter, _ = shape
    w13, s13, _, _ = make_weights(e, h, inter, "cuda")
    a = torch.zeros(rows * e, h, dtype=torch.float8_e4m3fn, device="cuda")
    a_s = torch.ones(rows * e * (h // 128), device="cuda")
    out = torch.empty(rows * e, 2 * inter, dtype=torch.bfloat16, device="cuda")
    runs = [(i, i * rows, rows) for i in range(e)]
    w_t, ws_t = C.expert_weights(w13, s13)

    def views():
        return [(a[s:s + r], w_t[i], C.expert_scales(a_s, s, r, h), ws_t[i], out[s:s + r]) for i, s, r in runs]

    built = views()

    def bare():
        for x, w, sa, sw, o in built:
            torch._scaled_mm(x, w, sa, sw, out_dtype=torch.bfloat16, out=o)

    result = {}
    for name, fn in {"views": views, "scaled_mm": bare, "expert_gemms": lambda: C.expert_gemms(
            a, a_s, w13, s13, out, runs)}.items():
        fn()
        times = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) / e * 1e6)
        result[f"host_us_{name}"] = sorted(times)[reps // 2]
    result["gpu_us_scaled_mm"] = event_time(bare, reps) / e * 1e6
    print("host costs an expert GEMM (us): " + ", ".join(f"{k} {v:.1f}" for k, v in result.items()), flush=True)
    return result


def _run_once(fn) -> float:
    fn()
    return float("nan")


def stage_text(r: dict) -> str:
    text = f"stage {r['stage']:18s} {r['us']:9.1f} us"
    if r["tflops"] > 0:
        text += f" {r['tflops']:7.1f} TF/s  ratio {r['ratio']:.3f}"
    if r["bytes"]:
        text += (f" {r['bytes'] / 1e6:7.1f} MB  {r['bytes'] / (r['us'] * 1e-6) / 1e12:5.2f} TB/s  (HBM floor "
                 f"{r['bytes'] / HBM * 1e6:6.1f} us)")
    return text


def write(out: Path, peak: float, rows: list[dict], stages: list[dict], host: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_moe_prefill.json").write_text(json.dumps({"fp8_peak_flops": peak, "rows": rows,
                                                            "stages": stages, "host": host}, indent=1))
    lines = [f"FP8 peak (_scaled_mm 8192^3): {peak / 1e12:.0f} TFLOP/s", "",
             "| T | routing | variant | us | TFLOP/s | ratio | rel err |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['T']} | {r['dist']} | {r['variant']} | failed | | | |")
        else:
            lines.append(f"| {r['T']} | {r['dist']} | {r['variant']} | {r['us']:.0f} | {r['tflops']:.0f} | "
                         f"{r['ratio']:.3f} | {r['rel_err']:.4f} |")
    if stages:
        lines += ["", f"Stages of {stages[0]['variant']} at T={stages[0]['T']}:", ""]
        lines += [f"    {stage_text(r)}" for r in stages]
    (out / "sweep_moe_prefill.md").write_text("\n".join(lines) + "\n")


def best_dense(rows: list[dict], t: int) -> str | None:
    ok = [r for r in rows if r["T"] == t and r.get("ok") and r["config"].get("kernel") == "dense"]
    return min(ok, key=lambda r: r["us"])["variant"] if ok else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/sweep_moe_prefill")
    ap.add_argument("--tokens", default="4096,8192,16384")
    ap.add_argument("--dists", default="uniform,skewed")
    ap.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--host", action="store_true", help="also the cuBLAS path's host cost an expert GEMM")
    ap.add_argument("--stage-tokens", default="", help="T of the stage breakdown (default: the first of --tokens)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--offline", action="store_true", help="sm_90 compile report of every variant, no GPU")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    if args.offline:
        from bench.offline_moe_prefill import report, report_data_movement

        print(report_data_movement(), flush=True)
        for name in names:
            print(report(name, CONFIGS[name]), flush=True)
        return
    shape, dev = (SHAPE["tiny"], "cpu") if args.tiny else (SHAPE["slice"], "cuda")
    if args.tiny:  # the interpreter's numerics patched to the GPU's, as the kernel tests run it
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--tiny needs TRITON_INTERPRET=1 in the environment")
        from tests.kernels.gpu_common import _fix_the_interpreter

        _fix_the_interpreter()
    tokens = [int(t) for t in args.tokens.split(",")]
    dists = args.dists.split(",")
    peak = fp8_peak() if dev == "cuda" else float("nan")
    print(f"FP8 peak (_scaled_mm 8192^3): {peak / 1e12:.0f} TFLOP/s", flush=True)
    if dev == "cuda":
        status = precompile(names, shape, args.workers)
        names = [n for n in names if status[n] == "ok"]
    host = host_costs(shape) if args.host and dev == "cuda" else {}
    rows = sweep(names, tokens, dists, shape, dev, args.reps, peak)
    stages = []
    t_stage = int(args.stage_tokens or tokens[0])
    best = best_dense(rows, t_stage)
    if best:
        print(f"-- stages of the fastest dense variant at T={t_stage}: {best}", flush=True)
        try:
            if CONFIGS[best].get("gemm") == "cublas":  # CUDA only: cuBLAS shapes never pass on the CPU
                stages = cublas_stage_breakdown(best, shape, t_stage, args.reps, peak)
            else:
                stages = stage_breakdown(best, shape, t_stage, args.reps, peak, dev)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    write(Path(args.out), peak, rows, stages, host)
    for t in tokens:
        print(f"fastest correct dense variant at T={t}: {best_dense(rows, t)}", flush=True)
    print_accuracy(rows)
    print(f"new default (fastest summed over every T and routing, correct in all): {overall_best(rows)}",
          flush=True)


def overall_best(rows: list[dict]) -> str | None:
    """The dense variant with the least total time over every (T, routing) row, among those correct in all."""
    total: dict[str, float] = {}
    bad = {r["variant"] for r in rows if not r.get("ok")}
    for r in rows:
        if r["config"].get("kernel") == "dense" and r["variant"] not in bad:
            total[r["variant"]] = total.get(r["variant"], 0.0) + r["us"]
    return min(total, key=total.get) if total else None


def print_accuracy(rows: list[dict]) -> None:
    """Worst relative error of each accumulation mode (and of the gather kernel) per batch: mma_acc's K sum runs
    through the FP8 MMA accumulator (reduced precision on sm_90), promote's is fp32 every 128 K."""
    def mode(conf: dict) -> str:
        if conf.get("kernel") != "dense":
            return "gather"
        from dsaserve.kernels import triton_moe_prefill as P

        full = {**P.PREFILL_CONFIG, **conf}  # as gemm_plan: the MMA accumulates only on one-scale tiles
        m1, m2 = (bool(P._key(full, "mma_acc", g)) and P.FP8_BLOCK % full[f"bn{g}"] == 0 for g in (1, 2))
        return {(False, False): "promote", (True, True): "mma_acc", (False, True): "mma_acc2 only",
                (True, False): "mma_acc1 only"}[(m1, m2)]

    for key in sorted({(r["T"], r["dist"]) for r in rows}):
        worst: dict[str, float] = {}
        for r in rows:
            if (r["T"], r["dist"]) == key and "rel_err" in r:
                m = mode(r["config"])
                worst[m] = max(worst.get(m, 0.0), r["rel_err"])
        print(f"accuracy T={key[0]} {key[1]}: worst rel err " + ", ".join(f"{m} {v:.4f}" for m, v in worst.items()),
              flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    main()
