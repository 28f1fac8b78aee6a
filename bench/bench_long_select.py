"""The split radix top-k select alone (`kernels/triton_indexer_long.long_row_select`), checked bit for bit against
the one-program kernel (`triton_indexer._topk_select_kernel`, a row over L2 past 16K keys) on the same scores.
The A/B against the design before it (every program re-derived the prefix from the rounds' histograms, a ballot
histogram in every round: bench/long_select_v0.py at commit ebc515b) is in bench/RESULTS.md, thirteenth session.

Run on the device:  PYTHONPATH=. python bench/bench_long_select.py --out $OUT [--window]   (~1 min on one H200;
                    --window: each case also with the window pass before round 0, `window_*` fields; the
                    pass is the default select's, the base case runs without it)
CPU smoke test:     TRITON_INTERPRET=1 PYTHONPATH=. python bench/bench_long_select.py --interpret --out DIR
Cases (rows x keys, every token at the last position, GLM-5.3's top-2048 and 64-token pages): decode at batch 1
(1 x 32768, 1 x 131072: 8 / 32 programs a launch at the decode chunk, 4096), a prefill slice of the 64 MB
workspace at 128K context (128 x 131072, the prefill chunk 2048) and larger slices (2048 x 131072,
4096 x 32768), each on two score kinds: "normal" (randn: the k-th key's 24-bit bucket usually alone) and
"ties" (randn rounded to 1/4: full 32-bit ties taken in part). Times are CUDA-event means of back-to-back
calls (`sweep_indexer_prefill.timer`: launch overhead overlapped as in a pipelined step) and of CUDA-graph replays
(`graph_us`: a decode step's graph has no host launch cost, which the one-row cases are otherwise bound by).
Writes bench_long_select.json.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from bench.sweep_indexer_prefill import timer
from dsaserve.kernels import triton_indexer, triton_indexer_long

TOPK, PS = 2048, 64
CASES = ((1, 32768, 4096), (1, 131072, 4096), (128, 131072, 2048), (2048, 131072, 2048), (4096, 32768, 2048))
KINDS = ("normal", "ties")


def _case(rows: int, keys: int, kind: str, dev: str):
    g = torch.Generator(device=dev).manual_seed(rows * 7 + keys)
    s = torch.randn(rows, keys, generator=g, device=dev)
    if kind == "ties":
        s = (s * 4).round() / 4
    table = torch.arange(keys // PS, device=dev)[None, :].repeat(1, 1)
    req = torch.zeros(rows, dtype=torch.int64, device=dev)
    pos = torch.full((rows,), keys - 1, dtype=torch.int64, device=dev)
    return s, table, req, pos


def _graph_time(fn, steps: int) -> float | None:
    """Seconds a replay of `fn` captured in a CUDA graph takes (GPU time with launches as a decode step's graph has
    them: no host launch cost), or None off CUDA."""
    if not torch.cuda.is_available():
        return None
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / steps


def per_launch_us(args: tuple, steps: int) -> list[float] | None:
    """Mean µs of each of `long_row_select`'s launches in order ([window,] rounds 0-3, count, write[, the mapping
    of positions to slots from LATE_SLOTS_ROWS rows]; the
    workspace's memset runs before the first event), CUDA events between them (PDL overlap lost at each event:
    the sum passes the pipelined time), or None off CUDA."""
    if not torch.cuda.is_available():
        return None
    sums: list[float] = []
    for _ in range(steps):
        todo = triton_indexer_long.launches(*args)  # zeroes a fresh workspace
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(todo) + 1)]
        events[0].record()
        for i, (kernel, grid, a, kw) in enumerate(todo):
            kernel[grid](*a, **kw)
            events[i + 1].record()
        torch.cuda.synchronize()
        times = [events[i].elapsed_time(events[i + 1]) * 1e3 for i in range(len(todo))]
        sums = [x + y for x, y in zip(sums, times, strict=True)] if sums else times
    return [round(t / steps, 2) for t in sums]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--interpret", action="store_true", help="tiny shapes for the Triton interpreter")
    ap.add_argument("--window", action="store_true", help="also each case with the window pass before round 0")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cases = ((1, 4096, 1024), (2, 8192, 2048)) if args.interpret else CASES
    topk = 256 if args.interpret else TOPK
    results = []
    for rows, keys, chunk in cases:
        for kind in KINDS:
            s, table, req, pos = _case(rows, keys, kind, dev)
            row = {"rows": rows, "keys": keys, "chunk": chunk, "kind": kind}
            steps = 1 if args.interpret else max(5, min(200, (1 << 27) // (rows * keys)))
            want = torch.empty((rows, topk), dtype=torch.int64, device=dev)
            grid, launch_args, kwargs = triton_indexer.row_select_launch(s, table, req, pos, want, keys, topk, PS)
            triton_indexer._topk_select_kernel[grid](*launch_args, **kwargs)
            for window in (False, True) if args.window else (False,):
                tag = "window_" if window else ""
                out = torch.empty((rows, topk), dtype=torch.int64, device=dev)
                fn = functools.partial(triton_indexer_long.long_row_select, s, table, req, pos, out, topk, PS,
                                       chunk=chunk, window=window)
                row[tag + "us"] = round(timer(fn, steps) * 1e6, 2)
                graph_s = _graph_time(fn, steps)
                if graph_s is not None:
                    row[tag + "graph_us"] = round(graph_s * 1e6, 2)
                    row[tag + "launch_us"] = per_launch_us((s, table, req, pos, out, topk, PS, chunk, window), steps)
                fn()
                row[tag + "equal"] = bool(torch.equal(out, want))
            print(json.dumps(row), flush=True)
            results.append(row)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "bench_long_select.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
