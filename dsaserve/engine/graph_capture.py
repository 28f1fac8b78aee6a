"""One CUDA graph's capture without torch.cuda.graph's per-capture housekeeping (startup chain: "capture CUDA
graphs"; used by engine/cuda_graph_runner.py and engine/piecewise_runner.py).

Owns: `lean_capture`. torch.cuda.graph synchronizes, runs a full `gc.collect()` and `empty_cache()` before
every capture: a start captures ~13 decode graphs and one graph per segment of every piecewise bucket, and on
the serving process's heap a full collection each time is a good part of the capture phase (vLLM patches
them out likewise). The callers synchronize once before their captures; the pool stays warm between them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def lean_capture(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream) -> Iterator[None]:
    """Capture into `graph` (memory from `pool`: a handle to share, or None for a new one) on `stream`, a
    side stream (the legacy default stream cannot capture); the caller synchronized before."""
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        finally:
            graph.capture_end()
