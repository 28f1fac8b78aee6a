"""What a decode graph's input copy costs at each page-table width class (issue 17: batched decode at long context).

A replayed decode step's first node copies its inputs out of a pinned host twin (`engine/cuda_graph_runner.py`):
five per-token rows of max_bs int64 and the bucket's page-table rows, `bucket x max_pages` int64, where max_pages is
the width class's (the narrow class: the top-k's pages; the widest: max_model_len's). Every kernel of the step waits
for it. This times that copy alone as a graph node, as the runner captures it, for each bucket and width, next to
the bytes it moves (µs, and GB/s of the host link). `--chain`: a graph of the copy node then a chain of small
kernels against the same chain after the engine's kernel that reads the pinned buffer itself
(`triton_elementwise.copy_from_host`: zero-copy over the host link), each replay timed from an event before it to
one after it: the b1 step's first kernel after the copy started ~14 µs after the copy ended (forty-sixth session's
timeline).

`--deltas`: the kernel that reads only the table's changes instead (`stage_from_host`), at 0, 2, a page a row and a
full-width row's changes.

Run on the device:  PYTHONPATH=. python bench/probe_table_copy.py --out DIR [--chain] [--deltas]   (~10 s)
Writes probe_table_copy.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dsaserve.engine.cuda_graph_runner import INPUT_ROWS
from dsaserve.kernels import triton_elementwise
from dsaserve.kernels.cublaslt_tuning import replay_seconds

PS = 64
# the top-k's 2048 keys, 32K and 64K (the few-row classes), bench_gpu's 128K and GLM-5.3's 202,752 positions
WIDTH_KEYS = (2048, 32768, 65536, 131072 + 64, 202752)


def back_to_back_us(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """µs a replay of `reps` replays launched back to back (one event before them, one after)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def copy_us(n: int, reps: int = 50) -> float:
    """µs a replay of a graph holding one pinned-host -> device copy of n int64 (and nothing else)."""
    src = torch.zeros(n, dtype=torch.int64).pin_memory()
    dst = torch.empty(n, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dst.copy_(src, non_blocking=True)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return back_to_back_us(graph, reps)


def chain_us(n: int, zero_copy: bool, kernels: int = 20, reps: int = 50) -> dict:
    """µs a replay (event to event, one replay at a time, and back to back) of a graph: the n-int64 input copy (a
    copy node, or with zero_copy a kernel reading the pinned buffer), then `kernels` small dependent kernels."""
    src = torch.arange(n, dtype=torch.int64).pin_memory()
    dst = torch.zeros(n, dtype=torch.int64, device="cuda")
    x = torch.zeros(4096, device="cuda")
    assert not zero_copy or 8 * n <= triton_elementwise.HOST_READ_MAX_BYTES, "past the kernel's limit: a copy"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        if zero_copy:
            triton_elementwise.copy_from_host(dst, src)
        else:
            dst.copy_(src, non_blocking=True)
        x.add_(dst[:1].float())
        for _ in range(kernels - 1):
            x.mul_(1.0001)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src), "the graph's input copy did not land"
    src.add_(1)  # written after the capture: the replay must read it as it is now
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src), "a replay did not read the pinned buffer as it is"
    one = sorted(t * 1e6 for t in replay_seconds(graph, reps))
    return {"one_median_us": round(one[len(one) // 2], 2), "one_min_us": round(one[0], 2),
            "back_to_back_us": round(back_to_back_us(graph, reps), 2)}


def stage_us(rows: int, pages: int, bucket: int, count: int, reps: int = 50) -> float:
    """µs a replay of what a wide class's graph runs in place of the whole table's copy (engine/
    page_table_mirror.py): the kernel that reads the per-token rows and `count` page-table changes out of the pinned
    buffer into the device's copy of the requests' pages (`stage_from_host`), then the bucket's rows gathered from it
    into the graph's table."""
    max_deltas = pages + 2 * bucket
    src = torch.zeros(rows + bucket, dtype=torch.int64)
    src[rows:] = torch.randperm(bucket)
    changes = torch.zeros(1 + 2 * max_deltas, dtype=torch.int64)
    changes[0] = count
    changes[1:1 + count] = torch.randperm(bucket * pages)[:count]
    src, changes = src.pin_memory(), changes.pin_memory()
    dst = torch.zeros(rows + bucket, dtype=torch.int64, device="cuda")
    mirror, table = (torch.zeros(bucket, pages, dtype=torch.int64, device="cuda") for _ in range(2))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_elementwise.stage_from_host(dst, src, mirror.view(-1), changes, max_deltas)
        torch.index_select(mirror, 0, dst[rows:], out=table)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    return back_to_back_us(graph, reps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--buckets", default="1,2,64,128")
    ap.add_argument("--max-bs", type=int, default=128, help="the runner's max_bs (its per-token rows' length)")
    ap.add_argument("--chain", action="store_true", help="also the copy node against a zero-copy kernel (docstring)")
    ap.add_argument("--deltas", action="store_true", help="also the changes' kernel at 0, 2, a page a row and a "
                    "full-width row's changes (`stage_us`)")
    args = ap.parse_args()
    rows = []
    if args.chain:
        for n in (INPUT_ROWS * args.max_bs + 32, INPUT_ROWS * args.max_bs + 128 * 32, INPUT_ROWS * args.max_bs + 1024):
            for zero_copy in (False, True, False, True):
                rows.append({"chain_n": n, "zero_copy": zero_copy, **chain_us(n, zero_copy)})
                print(rows[-1], flush=True)
    for keys in WIDTH_KEYS:
        pages = -(-keys // PS)
        for bucket in (int(b) for b in args.buckets.split(",")):
            n = INPUT_ROWS * args.max_bs + bucket * pages
            us = copy_us(n)
            rows.append({"width_keys": keys, "pages": pages, "bucket": bucket, "bytes": 8 * n, "us": round(us, 2),
                         "gb_s": round(8 * n / us / 1e3, 2)})
            print(rows[-1], flush=True)
            for count in (0, 2, bucket, pages) if args.deltas and bucket > 2 else ():
                us = round(stage_us(INPUT_ROWS * args.max_bs, pages, bucket, count), 2)
                rows.append({"width_keys": keys, "pages": pages, "bucket": bucket, "changes": count, "us": us})
                print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_table_copy.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
