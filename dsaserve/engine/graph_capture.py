"""One CUDA graph's capture without torch.cuda.graph's per-capture housekeeping (startup chain: "capture CUDA
graphs"; used by engine/cuda_graph_runner.py and engine/piecewise_runner.py).

Owns: `lean_capture`, and `capture_bucket`: one bucket's optional eager run and its capture, retried after an
eager run when a capture without one fails (both runners' warm-start path). torch.cuda.graph synchronizes, runs a
full `gc.collect()` and `empty_cache()` before every capture: a start captures ~13 decode graphs and one graph per
segment of every piecewise bucket, and on the serving process's heap a full collection each time is a good part of
the capture phase (vLLM patches them out likewise). The callers synchronize once before their captures; the pool
stays warm between them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

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


def capture_bucket(warm: Callable[[], dict[str, float]], capture: Callable[[], Any],
                   warm_first: bool) -> tuple[dict[str, float], Any, bool, bool]:
    """(collectives of the bucket's eager run, or {} without one; what `capture` made; whether the eager run
    happened; whether the capture was retried). warm_first=False (a warm start whose preload loaded every
    recorded kernel) captures straight away; if that capture raises (something first used inside it), the
    bucket runs eagerly once and is captured again. A capture that fails after its eager run raises."""
    static = warm() if warm_first else {}
    try:
        return static, capture(), warm_first, False
    except RuntimeError:
        if warm_first:
            raise
        torch.cuda.synchronize()
        return warm(), capture(), True, True

