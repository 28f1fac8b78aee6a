"""Where a replayed decode graph's ~9 µs between its first kernel and the next comes from (issue 17, batch 1).

Every replayed step's timeline opens with the graph's input kernel (`triton_elementwise._from_host_kernel`, ~3 µs,
reading the pinned staging buffer) and then ~8-9 µs with no kernel before `_resolve_kernel` (bench/RESULTS.md,
forty-sixth, fifty-second and fifty-fifth sessions: H100 and H200, 1K and 32K alike). The forty-sixth and
forty-seventh sessions ruled out the staging copy node and the fork of its event. This probe captures small graphs
that differ in one thing each and reads the same timeline of their replays (torch's profiler, median of
`--steps`): the first node (the pinned-host read, the same kernel over a device buffer, none), the chain after it
(PDL launches or plain ones), the graph's size (how many kernels follow) and a branch (an external event's record
or a kernel on a second stream, forking after the first node or later in the chain), and prints the gap from the
first kernel's end to the second's start, the chain's largest later gap and the replay's span, then the replay's
time without the profiler (synchronous and back to back: whether the gap is the profiler's). Found (fifty-seventh
session, H100): the gap comes with a branch forking right after the graph's first kernel (13-14 µs profiled, none
when it forks later) and is mostly the profiler's (1-2 µs back to back unprofiled).

    PYTHONPATH=. python bench/probe_graph_gap.py [--out DIR]     (~10 s)
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.bench_gpu import cuda_time, pipelined_time
from bench.profile_decode import cuda_events
from dsaserve.kernels import triton_elementwise
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

B1_INPUT_INT64S = 672  # b1's narrow class: five per-token rows and the top-k's page-table row (forty-sixth session)


@triton.jit
def _bump_kernel(x_ptr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def _graph(first: str, pdl: bool, chain: int, mark: str = "", fork_at: int = 0) -> torch.cuda.CUDAGraph:
    """A graph of `first` ("host": the input kernel over pinned memory; "device": the same kernel over a device
    buffer; "none") then `chain` dependent one-program kernels, PDL-launched or not. mark: after `fork_at` of the
    chain's kernels (0: right after the first node), on a branch stream that joins at the end, "event" an external
    event's record (the decode graphs' `CudaGraphRunner.staged`), "kernel" a one-program kernel of its own."""
    n = B1_INPUT_INT64S
    src = torch.zeros(n, dtype=torch.int64).pin_memory() if first == "host" else \
        torch.zeros(n, dtype=torch.int64, device="cuda")
    dst = torch.empty(n, dtype=torch.int64, device="cuda")
    x = torch.zeros(1, dtype=torch.int64, device="cuda")
    launch = pdl_args(x.device) if pdl else {"PDL": False}

    staged, branch = torch.cuda.Event(external=True), torch.cuda.Stream()
    y = torch.zeros(1, dtype=torch.int64, device="cuda")

    def fork() -> None:
        branch.wait_stream(torch.cuda.current_stream())
        if mark == "event":
            staged.record(branch)
        else:
            with torch.cuda.stream(branch):
                _bump_kernel[(1,)](y)

    def body() -> None:
        if first == "host":
            triton_elementwise.copy_from_host(dst, src)
        elif first == "device":
            triton_elementwise._from_host_kernel[(1,)](src, dst, n, BLOCK=triton_elementwise.HOST_READ_BLOCK)
        for i in range(chain):
            if mark and i == fork_at:
                fork()
            _bump_kernel[(1,)](x, **launch)
        if mark:
            torch.cuda.current_stream().wait_stream(branch)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.keep = (src, dst, x, y, staged, branch)  # the buffers live as long as the graph
    return graph


def gaps(graph: torch.cuda.CUDAGraph, steps: int) -> dict:
    """Median over `steps` replays: the gap from the first kernel's end to the chain's next kernel's start, that
    one's gap to the one after it, the chain's largest later gap and the kernel it ends before, and the replay's
    span (first start to last end), µs."""
    evs = cuda_events(graph.replay, steps)
    per = len(evs) // steps
    first_gap, second_gap, worst, worst_at, span = [], [], [], [], []
    for s in range(steps):
        step = sorted(evs[s * per:(s + 1) * per], key=lambda ev: ev.time_range.start)
        main_stream = collections.Counter(ev.device_resource_id for ev in step).most_common(1)[0][0]
        chain = [ev for ev in step[1:] if "_bump_kernel" in ev.name and ev.device_resource_id == main_stream]
        first_gap.append(chain[0].time_range.start - step[0].time_range.end)
        later = [b.time_range.start - a.time_range.end for a, b in itertools.pairwise(chain)]
        second_gap.append(later[0])
        worst.append(max(later[1:], default=0.0))
        worst_at.append(2 + later[1:].index(worst[-1]) if later[1:] else 0)
        span.append(max(ev.time_range.end for ev in step) - step[0].time_range.start)
    return {"kernels": per, "first_gap_us": statistics.median(first_gap),
            "second_gap_us": statistics.median(second_gap), "worst_later_gap_us": statistics.median(worst),
            "worst_later_before": statistics.median(worst_at), "span_us": statistics.median(span)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=9)
    args = ap.parse_args()
    rows = []
    cases = [(first, pdl, chain, "", 0) for first in ("host", "device", "none") for pdl in (True, False)
             for chain in (4, 100)]
    cases += [("host", pdl, chain, mark, 0) for mark in ("event", "kernel")
              for pdl, chain in ((True, 4), (True, 100), (False, 100), (True, 400))]
    cases += [("host", True, chain, "event", at) for chain, at in ((100, 50), (400, 50), (400, 300))]
    for first, pdl, chain, mark, at in cases:
        graph = _graph(first, pdl, chain, mark, at)
        r = {"first": first, "pdl": pdl, "chain": chain, "mark": mark, "fork_at": at, **gaps(graph, args.steps),
             "replay_us": cuda_time(graph.replay) * 1e6, "back_to_back_us": pipelined_time(graph.replay) * 1e6}
        rows.append(r)
        print(f"first {first:6s} pdl {pdl!s:5s} chain {chain:3d} mark {mark or '-':6s} at {at:3d}: gap after the "
              f"1st kernel {r['first_gap_us']:5.1f} µs, after the 2nd {r['second_gap_us']:5.1f}, largest later "
              f"{r['worst_later_gap_us']:5.1f} (before chain kernel {r['worst_later_before']:.0f}), span "
              f"{r['span_us']:6.1f}; unprofiled: replay {r['replay_us']:6.1f}, back to back "
              f"{r['back_to_back_us']:6.1f}",
              flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_graph_gap.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                   "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
