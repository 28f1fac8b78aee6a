"""Where a prefill's time goes (issue 17): per-kernel GPU time of one whole-model prefill, grouped by op.

Run on the device:  PYTHONPATH=. python bench/profile_prefill.py --out $OUT [--lengths 8192,32768]
For each prompt length it times the prefill (one request, one chunk) and profiles it under torch.profiler.
The table lists each kernel's ms and share, then the shares by op group (sparse MLA, indexer, MoE, GEMM,
...): which kernel issue 17 should take next ("anything above 5 % of a prefill step").
Where the wall time passes the kernels' sum it says why (`gaps`): the GPU's idle time inside one profiled
prefill (the span minus the union of its kernels), the host's time to issue the prefill (timed before the
length's profiles; the profiler slows the host's CUDA calls for the rest of the process, so only the first
length's is clean; near the wall time it says
the launch queue filled and the host waited for the GPU, not that the host is the bound), and every host sync
the prefill makes, by the Python line that made it (`torch.cuda.set_sync_debug_mode`).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.bench_gpu import cuda_time, measure_ceilings, prefill_flops
from bench.profile_decode import kernel_sources, kernel_table
from dsaserve.engine.memory_profile import dummy_prefill
from dsaserve.engine.model_runner import ModelRunner

# first matching substring of a kernel's name -> its op group (order matters: specific before generic)
GROUPS = (("sparse_mla", "sparse MLA"), ("_combine_kernel", "sparse MLA"), ("indexer", "indexer"),
          ("topk", "indexer"), ("radix", "indexer"), ("moe", "MoE"), ("_combine_k", "MoE"),
          ("route", "MoE router"), ("scaled_mm", "FP8 GEMM"), ("fp8_gemm", "FP8 GEMM"), ("gemm", "GEMM"),
          ("sm90_xmma", "GEMM"), ("cutlass", "GEMM"), ("nvjet", "GEMM"), ("quant", "quantise"),
          ("rms", "norm"), ("norm", "norm"), ("rope", "RoPE"), ("kv_write", "KV write"),
          ("elementwise", "elementwise"), ("sort", "sort"), ("scatter", "index ops"), ("gather", "index ops"),
          ("index", "index ops"), ("reduce", "reduce"), ("copy", "copy"), ("Memcpy", "copy"), ("fill", "fill"))


def group_of(name: str) -> str:
    low = name.lower()
    return next((g for key, g in GROUPS if key.lower() in low), "other")


def gpu_idle_ms(fn) -> tuple[float, float]:
    """(span, idle) in ms of one profiled call: first kernel start to last kernel end, and the part of it no
    kernel or copy covers."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = sorted((ev.time_range.start, ev.time_range.end) for ev in prof.events()
                   if ev.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in spans:  # union of the intervals
        if b > end:
            busy += b - max(a, end)
            end = b
    span = end - spans[0][0] if spans else 0.0  # the latest end, not the last start's
    return span / 1e3, (span - busy) / 1e3


def host_issue_ms(fn) -> float:
    """ms the host takes to issue one call (it returns before the GPU is done unless it syncs)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host * 1e3


def sync_sites(fn) -> dict[str, int]:
    """Host syncs of one call, counted by the Python line that made them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return dict(Counter(f"{w.filename.split('dsaserve/')[-1]}:{w.lineno}" for w in caught
                        if "synchroniz" in str(w.message)).most_common())


def ab_setting(name: str) -> list[tuple[dict, str, object]]:
    """(dict, key, value) changes of one --ab setting (a module's globals are its `vars`): "ws<N>M" the radix
    select's workspace chunk of N MB (`triton_indexer_gemm.LONG_WS_BUDGET`), "nowindow" the select without its
    window pass, "moe_triton" / "moe_cublas" the MoE prefill's expert GEMMs
    (`triton_moe_prefill.PREFILL_CONFIG["gemm"]`), "default" nothing."""
    from dsaserve.kernels import triton_indexer_gemm as g
    from dsaserve.kernels import triton_moe_prefill as moe

    if name.startswith("ws") and name.endswith("M"):
        return [(vars(g), "LONG_WS_BUDGET", int(name[2:-1]) << 20)]
    if name == "nowindow":
        return [(g.DEFAULT_CONFIG, "window", False)]
    if name in ("moe_triton", "moe_cublas"):
        return [(moe.PREFILL_CONFIG, "gemm", name[4:])]
    if name != "default":
        raise SystemExit(f"--ab: unknown setting {name!r} (ws<N>M, nowindow, moe_triton, moe_cublas, "
                         "default)")
    return []


def ab_walls(run, settings: list[str]) -> dict[str, float]:
    """ms of the prefill under each setting (`ab_setting`), in one process."""
    walls = {}
    for name in settings:
        changes = ab_setting(name)
        saved = [(d, k, d[k]) for d, k, _ in changes]
        for d, k, v in changes:
            d[k] = v
        try:
            walls[name] = cuda_time(run, iters=3, warmup=1) * 1e3
        finally:
            for d, k, v in saved:
                d[k] = v
    return walls


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="glm-5.3-slice")
    ap.add_argument("--out", default="profile-out")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--ab", default="", help="also time each length under these settings, e.g. "
                    "default,ws256M,nowindow,moe_triton (ab_setting)")
    ap.add_argument("--no-profile", action="store_true", help="only the wall time (and --ab)")
    ap.add_argument("--sources", default="", help="a regex of kernel names: print the torch ops that launched them")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    ceilings = measure_ceilings()
    runner = ModelRunner.from_kwargs(args.config, dtype="bfloat16", load_format="dummy", device="cuda",
                                     cuda_graph_max_bs=1, max_model_len=max(lengths) + 64,
                                     chunked_prefill_size=max(lengths), max_num_batched_tokens=max(lengths))
    report: dict = {"ceilings": ceilings, "impls": runner.manifest().get("kernels"), "cases": []}
    for n in lengths:
        batch = dummy_prefill(n, runner.page_size, runner.cfg.vocab_size, runner.device)
        run = lambda b=batch: runner.forward(b)  # noqa: E731
        wall = cuda_time(run, iters=3, warmup=1)
        gemm, attn = prefill_flops(runner.cfg, n)
        bound = gemm / ceilings["fp8_flops"] + attn / ceilings["bf16_flops"]
        if args.ab:
            walls = ab_walls(run, args.ab.split(","))
            print(f"== prefill {n} A/B (ms, FLOP roofline {bound * 1e3:.1f}): "
                  + ", ".join(f"{k} {v:.1f} ({v / 1e3 / bound:.3f}x)" for k, v in walls.items()))
            report.setdefault("ab", []).append({"tokens": n, "roofline_ms": bound * 1e3, "wall_ms": walls})
        if args.no_profile:
            (out / "profile_prefill.json").write_text(json.dumps(report, indent=1, default=float))
            continue
        host = host_issue_ms(run)  # before the profiler slows the host (gpu_idle_ms, kernel_table)
        rows, total_us = kernel_table(run, steps=2)
        span, idle = gpu_idle_ms(run)
        gaps = {"profiled_span_ms": span, "gpu_idle_ms": idle, "host_issue_ms": host, "syncs": sync_sites(run)}
        groups: dict[str, float] = defaultdict(float)
        for name, t, _ in rows:
            groups[group_of(name)] += t
        print(f"\n== prefill {n}: {wall * 1e3:.1f} ms, FLOP roofline {bound * 1e3:.1f} ms ({wall / bound:.2f}x); "
              f"kernels {total_us / 1e3:.1f} ms")
        print(f"  gaps: GPU idle {idle:.1f} of a profiled {span:.1f} ms; the host issues the prefill in "
              f"{gaps['host_issue_ms']:.1f} ms; host syncs by line: {gaps['syncs'] or 'none'}")
        for g, t in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {g:<14} {t / 1e3:9.2f} ms  {100 * t / total_us:5.1f} %")
        print(f"{'ms':>9} {'%':>6} {'n':>4}  kernel")
        for name, t, k in rows[: args.top]:
            print(f"{t / 1e3:9.3f} {100 * t / total_us:6.1f} {k:4d}  {name}")
        sources = kernel_sources(run, args.sources) if args.sources else []
        for src in sources:
            print(f"  {src['ms']:8.2f} ms {src['kernels']:4d}x  {src['op']} {src['shapes']}  at {src['at']}")
        report["cases"].append({"tokens": n, "wall_ms": wall * 1e3, "roofline_ms": bound * 1e3,
                                "kernel_sum_ms": total_us / 1e3, "gaps": gaps,
                                "groups_ms": {g: t / 1e3 for g, t in groups.items()}, "kernels": rows,
                                "sources": sources})
        (out / "profile_prefill.json").write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
