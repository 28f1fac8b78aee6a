"""Where a replayed decode graph's ~9 µs between its first kernel and the next comes from (issue 17, batch 1).

Every replayed step's timeline opens with the graph's input kernel (`triton_elementwise._from_host_kernel`, ~3 µs,
reading the pinned staging buffer) and then ~8-9 µs with no kernel before `_resolve_kernel` (bench/RESULTS.md,
forty-sixth, fifty-second and fifty-fifth sessions: H100 and H200, 1K and 32K alike). The forty-sixth and
forty-seventh sessions ruled out the staging copy node and the fork of its event. This probe captures small graphs
that differ in one thing each and reads the same timeline of their replays (torch's profiler, median of
`--steps`): the first node (the pinned-host read, the same kernel over a device buffer, none), the chain after it
(PDL launches or plain ones) and the graph's size (how many kernels follow), and prints the gap from the first
kernel's end to the second's start and the replay's span.

    PYTHONPATH=. python bench/probe_graph_gap.py [--out DIR]     (~10 s)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.profile_decode import cuda_events
from dsaserve.kernels import triton_elementwise
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

B1_INPUT_INT64S = 672  # b1's narrow class: five per-token rows and the top-k's page-table row (forty-sixth session)


@triton.jit
def _bump_kernel(x_ptr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    tl.store(x_ptr, tl.load(x_ptr) + 1)


def _graph(first: str, pdl: bool, chain: int, mark: str = "") -> torch.cuda.CUDAGraph:
    """A graph of `first` ("host": the input kernel over pinned memory; "device": the same kernel over a device
    buffer; "none") then `chain` dependent one-program kernels, PDL-launched or not. mark: after the first
    kernel, on a branch stream that joins at the end, "event" an external event's record (the decode graphs'
    `CudaGraphRunner.staged`), "token" the kernel writing a pinned word (`signal_host`, STAGED_MARK "token")."""
    n = B1_INPUT_INT64S
    src = torch.zeros(n, dtype=torch.int64).pin_memory() if first == "host" else \
        torch.zeros(n, dtype=torch.int64, device="cuda")
    dst = torch.empty(n, dtype=torch.int64, device="cuda")
    x = torch.zeros(1, dtype=torch.int64, device="cuda")
    launch = pdl_args(x.device) if pdl else {"PDL": False}

    staged, branch = torch.cuda.Event(external=True), torch.cuda.Stream()
    words = torch.zeros(2, dtype=torch.int64).pin_memory()

    def body() -> None:
        if first == "host":
            triton_elementwise.copy_from_host(dst, src)
        elif first == "device":
            triton_elementwise._from_host_kernel[(1,)](src, dst, n, BLOCK=triton_elementwise.HOST_READ_BLOCK)
        if mark:
            branch.wait_stream(torch.cuda.current_stream())
            if mark == "event":
                staged.record(branch)
            else:
                with torch.cuda.stream(branch):
                    triton_elementwise.signal_host(words[1:], words[:1])
        for _ in range(chain):
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
    graph.keep = (src, dst, x, staged, branch, words)  # the buffers live as long as the graph
    return graph


def gaps(graph: torch.cuda.CUDAGraph, steps: int) -> dict:
    """Median over `steps` replays: the gap from the first kernel's end to the chain's next kernel's start, that
    one's gap to the one after it, and the replay's span (first start to last end), µs."""
    evs = cuda_events(graph.replay, steps)
    per = len(evs) // steps
    first_gap, second_gap, span = [], [], []
    for s in range(steps):
        step = sorted(evs[s * per:(s + 1) * per], key=lambda ev: ev.time_range.start)
        chain = [ev for ev in step[1:] if "_bump_kernel" in ev.name]  # not the branch's signal kernel
        first_gap.append(chain[0].time_range.start - step[0].time_range.end)
        second_gap.append(chain[1].time_range.start - chain[0].time_range.end)
        span.append(max(ev.time_range.end for ev in step) - step[0].time_range.start)
    return {"kernels": per, "first_gap_us": statistics.median(first_gap),
            "second_gap_us": statistics.median(second_gap), "span_us": statistics.median(span)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--steps", type=int, default=9)
    args = ap.parse_args()
    rows = []
    cases = [(first, pdl, chain, "") for first in ("host", "device", "none") for pdl in (True, False)
             for chain in (4, 100)] + [("host", pdl, chain, mark) for mark in ("event", "token")
                                       for pdl, chain in ((True, 4), (True, 100), (False, 100))]
    for first, pdl, chain, mark in cases:
        r = {"first": first, "pdl": pdl, "chain": chain, "mark": mark,
             **gaps(_graph(first, pdl, chain, mark), args.steps)}
        rows.append(r)
        print(f"first {first:6s} pdl {pdl!s:5s} chain {chain:3d} mark {mark or '-':5s}: gap after the 1st kernel "
              f"{r['first_gap_us']:5.1f} µs, after the 2nd {r['second_gap_us']:5.1f}, span {r['span_us']:6.1f}",
              flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe_graph_gap.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                                   "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
