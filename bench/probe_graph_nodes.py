"""The nodes of a replayed decode graph as CUDA writes them (the driver's `cuGraphDebugDotPrint`): which kernels,
copies, event records and forks a step's graph holds and in what order. First asked for the ~9 µs with no kernel
after every replayed step's input kernel (bench/RESULTS.md, forty-sixth to fifty-seventh sessions: the branch forking
there, and mostly the profiler's view of it).

    PYTHONPATH=. python bench/probe_graph_nodes.py --bs 1 --context 1024 --out DIR

Writes DIR/decode_w<width>_bs<bs>.dot for each width class's graph of that bucket and prints, per graph, the node
kinds it holds, its edges' attributes by count (the driver prints an edge's type or port as `headlabel`), and the first
nodes from its roots with their edges.
"""

from __future__ import annotations

import argparse
import ctypes
import re
from collections import Counter
from pathlib import Path

import torch

NODE = re.compile(r'"(graph_\d+_node_\d+)"\s*\[(.*?)\];', re.S)
EDGE = re.compile(r'"(graph_\d+_node_\d+)"\s*->\s*"(graph_\d+_node_\d+)"(?:\s*\[(.*?)\])?')


class _KeptGraph(torch.cuda.CUDAGraph):
    """A graph that keeps its cudaGraph_t (`keep_graph`: instantiated at its first replay), so the driver can print
    it. torch's own `debug_dump` wrote no file on the device's torch 2.11 (fifty-third to fifty-sixth sessions)."""

    def __init__(self, *args, **kwargs):
        super().__init__(keep_graph=True)


def dump_dot(graph: torch.cuda.CUDAGraph, path: Path) -> None:
    """The graph's DOT (verbose: kernels' names and launch parameters) through the driver API."""
    driver = ctypes.CDLL("libcuda.so.1")
    rc = driver.cuGraphDebugDotPrint(ctypes.c_void_p(graph.raw_cuda_graph()), str(path).encode(), ctypes.c_uint(1))
    if rc != 0:
        raise RuntimeError(f"cuGraphDebugDotPrint: CUresult {rc} for {path}")


def demangle(name: str) -> str:
    """A mangled C++ kernel's nested name (`_ZN2at6native29vectorized_elementwise_kernelILi4E...` ->
    `at::native::vectorized_elementwise_kernel`); any other name as it is."""
    if not name.startswith("_Z"):
        return name
    parts, i = [], 3 if name.startswith("_ZN") else 2
    while (m := re.match(r"\d+", name[i:])) is not None:
        n = int(m.group(0))
        parts.append(name[i + len(m.group(0)):i + len(m.group(0)) + n])
        i += len(m.group(0)) + n
    return "::".join(parts) or name


def kind(attrs: str) -> str:
    """A node's kind out of its DOT attributes, as the driver writes them: a record label that opens with the node's
    type (KERNEL, MEMSET, EVENT_RECORD, ...); a kernel's, its function's name (the ID row's third field, before
    its launch shape)."""
    label = attrs.split('label="', 1)[-1]
    node_type = re.search(r"\b([A-Z][A-Z_]{2,})\b", label)
    kernel = re.search(r"\{ID \|[^|]*\|\s*([^|}\\<\s]+)", label)
    if node_type and node_type.group(1) == "KERNEL" and kernel:
        return demangle(kernel.group(1))[:60]
    return node_type.group(1) if node_type else " ".join(label.split())[:60]


def first_nodes(dot: str, n: int) -> list[str]:
    """The graph's nodes breadth-first from its roots: each with its kind and the edges that leave it."""
    nodes = {m.group(1): kind(m.group(2)) for m in NODE.finditer(EDGE.sub("", dot))}
    out_edges: dict[str, list[tuple[str, str]]] = {k: [] for k in nodes}
    indeg = Counter()
    for m in EDGE.finditer(dot):
        if m.group(1) in nodes:
            out_edges[m.group(1)].append((m.group(2), " ".join((m.group(3) or "").split())[:40]))
            indeg[m.group(2)] += 1
    order, seen = [k for k in nodes if indeg[k] == 0], set()
    lines = []
    while order and len(lines) < n:
        k = order.pop(0)
        if k in seen:
            continue
        seen.add(k)
        lines.append(f"{k}: {nodes[k]} -> " + ", ".join(f"{d}({nodes.get(d, '?')[:24]}{' ' + e if e else ''})"
                                                        for d, e in out_edges[k]))
        order.extend(d for d, _ in out_edges[k])
    edges = Counter(" ".join((m.group(3) or "").split()) or "(none)" for m in EDGE.finditer(dot))
    lines.insert(0, "edges: " + ", ".join(f"{v} x{c}" for v, c in edges.most_common(6)))
    lines.insert(0, "kinds: " + ", ".join(f"{v} x{c}" for v, c in Counter(nodes.values()).most_common(12)))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="glm-5.3-slice")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--first", type=int, default=14, help="nodes to print from each graph's roots")
    ap.add_argument("--out", default="graph-nodes")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.cuda.CUDAGraph = _KeptGraph  # the runners make their graphs as torch.cuda.CUDAGraph()
    from dsaserve.engine.model_runner import ModelRunner

    runner = ModelRunner.from_kwargs(args.config, dtype="bfloat16", load_format="dummy", device="cuda",
                                     cuda_graph_max_bs=args.bs, max_model_len=args.context + 64)
    for width, graphs in [*runner.graphs.runners.items(), *runner.graphs.few.items()]:
        if args.bs not in graphs.graphs:
            continue
        path = out / f"decode_w{width}_bs{args.bs}.dot"
        dump_dot(graphs.graphs[args.bs].graph, path)
        print(f"== {path.name}", *first_nodes(path.read_text(), args.first), sep="\n  ", flush=True)


if __name__ == "__main__":
    main()
