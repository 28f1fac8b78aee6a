"""Counters: the measured side of the ledger, and the cold-path counters of the startup chain.

Owns: one process-wide registry of named integer/float counters that hot paths bump cheaply
(`COUNTERS.add("kv_bytes_written", n)`), snapshotted per step or per run. The ledger's `--reconcile`
puts these next to its predictions; `/metrics` exports them. Names are stable (the ledger and the
README's JSON keys use them):

  weight_bytes_read        bytes of weights the forward read (FP8 bytes + scales, or dequantised bytes)
  kv_bytes_written         main-KV bytes written to the pool (layout bytes per token x layers)
  kv_bytes_read            main-KV bytes gathered by attention (only the selected top-k slots)
  indexer_bytes_written    indexer-K bytes written
  indexer_bytes_read       indexer-K bytes scored
  collective_calls.<kind>  calls of each collective (all_reduce, all_gather, all_to_all, ...)
  collective_bytes.<kind>  sender bytes of each collective
  forward_steps            model forwards; decode_steps / prefill_tokens / decode_tokens likewise
  graph_replays            CUDA-graph replays; eager_fallbacks.<reason> eager runs by reason
"""

from __future__ import annotations

import threading
from collections import defaultdict


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = defaultdict(float)
        self.enabled = True

    def add(self, name: str, value: float = 1) -> None:
        if self.enabled:
            self._values[name] += value

    def get(self, name: str) -> float:
        return self._values.get(name, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def reset(self) -> None:
        with self._lock:
            self._values.clear()

    @staticmethod
    def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
        return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


COUNTERS = Counters()
