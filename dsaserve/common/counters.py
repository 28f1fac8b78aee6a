"""Counters: the measured side of the ledger, and the cold-path counters of the startup chain.

Owns: one process-wide registry of named integer/float counters that hot paths bump cheaply
(`COUNTERS.add("kv_bytes_written", n)`), snapshotted per step or per run. The ledger's `--reconcile`
puts these next to its predictions; `/metrics` exports them. Names are stable (the ledger and the
README's JSON keys use them); `COUNTER_NAMES` / `COUNTER_FAMILIES` below are this list as code (a run file's
counters are checked against it):

  weight_bytes_read        bytes of weights the forward read (FP8 bytes + scales, or dequantised bytes)
  kv_bytes_written         main-KV bytes written to the pool (layout bytes per token x layers)
  kv_bytes_read            main-KV bytes gathered by attention (only the selected top-k slots, at the cache's row
                           size: a staged prefill gathers the same slots from their bf16 copies)
  kv_bytes_staged          a prefill's main-KV rows read once a layer and written as bf16 for sparse MLA
                           (model/layers/prefill_staging.py): rows x (layout row bytes + bf16 row bytes)
  indexer_bytes_written    indexer-K bytes written
  indexer_bytes_read       indexer-K bytes scored
  moe_experts_touched      distinct routed experts read, summed over MoE layers and forwards
  collective_calls.<kind>  calls of each collective (all_reduce, all_gather, all_to_all, ...)
  collective_bytes.<kind>  message bytes of each collective (what one rank sends)
  collective_wire_bytes.<kind>  bytes on the wire per rank (ring all-reduce: 2(n-1)/n x message)
  forward_steps            model forwards
  idle_steps               DP-attention: steps a rank had no tokens and only took part in the MoE exchange
  graph_replays            decode CUDA-graph replays; piecewise_replays steps on the piecewise graphs;
                           eager_fallbacks.<reason> eager runs by reason (only counted where graphs exist);
                           eager_large_steps steps over the largest piecewise bucket (eager by design)
  mtp_graph_replays        speculative decoding's MTP forwards replayed in their CUDA graphs (engine/mtp_graphs.py);
                           mtp_eager.<reason> those run eagerly where the graphs exist (a long prompt's extend)
  kernel_compiles_after_up Triton kernels compiled after startup (a cold path warmup did not cover)
  kernel_loads_after_up    Triton kernels the JIT compiled or loaded from its disk cache after startup
  device_busy_seconds      GPU time of the engine's steps (engine/device_timer.py)
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
COUNTER_NAMES = frozenset({
    "weight_bytes_read", "kv_bytes_written", "kv_bytes_read", "kv_bytes_staged", "indexer_bytes_written",
    "indexer_bytes_read", "moe_experts_touched", "forward_steps", "idle_steps", "graph_replays", "piecewise_replays",
    "eager_fallbacks", "eager_large_steps", "kernel_compiles_after_up", "kernel_loads_after_up",
    "device_busy_seconds", "mtp_graph_replays"})
# family -> the kinds after its dot (None: any non-empty reason)
COUNTER_FAMILIES: dict[str, tuple[str, ...] | None] = {
    "collective_calls": COLLECTIVE_KINDS, "collective_bytes": COLLECTIVE_KINDS,
    "collective_wire_bytes": COLLECTIVE_KINDS, "eager_fallbacks": None, "mtp_eager": None}


def is_counter_name(name: str) -> bool:
    """A name of the list above: `kv_bytes_read`, `collective_calls.all_reduce`, `eager_fallbacks.<reason>`."""
    if name in COUNTER_NAMES:
        return True
    family, dot, kind = name.partition(".")
    if not dot or family not in COUNTER_FAMILIES or not kind:
        return False
    kinds = COUNTER_FAMILIES[family]
    return kinds is None or kind in kinds


def ring_wire_factor(kind: str, n: int) -> float:
    """Bytes one of n ranks sends per message byte under the ring algorithms (DESIGN.md "The ledger"):
    all_reduce 2(n-1)/n, all_gather / reduce_scatter / broadcast (n-1)/n; 0 for one rank. The counting
    wrapper and the ledger share it; all_to_all has no ring factor (the wrapper counts its splits)."""
    if n <= 1:
        return 0.0
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "broadcast"):
        return (n - 1) / n
    raise ValueError(f"collective kind {kind!r}: no ring factor (all_reduce, all_gather, reduce_scatter, broadcast)")


def _check_name(name: str) -> None:
    if not is_counter_name(name):
        raise ValueError(f"counter {name!r} is not in common/counters.py's COUNTER_NAMES / COUNTER_FAMILIES: a run "
                         "file with it would not load (ledger/reconcile.py); add it there")


class Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, float] = defaultdict(float)
        self._sources: list[Callable[[bool], dict[str, float]]] = []
        self.enabled = True
        self.strict_names = False  # the tests: a name outside COUNTER_NAMES / COUNTER_FAMILIES raises at its first add

    def add_source(self, read: Callable[[bool], dict[str, float]]) -> None:
        """A counter kept elsewhere (e.g. on a GPU, to avoid a sync per step), folded in at snapshot time.
        `read(reset)` returns its values and zeroes them when `reset` is true."""
        self._sources.append(read)

    def add(self, name: str, value: float = 1) -> None:
        if self.enabled:
            if self.strict_names and name not in self._values:
                _check_name(name)
            self._values[name] += value

    def get(self, name: str) -> float:
        return self.snapshot().get(name, 0) if self._sources else self._values.get(name, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._values)
            for read in self._sources:
                for k, v in read(False).items():
                    if self.strict_names:
                        _check_name(k)
                    out[k] = out.get(k, 0) + v
            return out

    def host_values(self) -> dict[str, float]:
        """Only the host-side counters (no device sync): for measuring one run's delta and undoing it."""
        return dict(self._values)

    def restore(self, values: dict[str, float]) -> None:
        with self._lock:
            self._values = defaultdict(float, values)

    def reset(self) -> None:
        with self._lock:
            self._values.clear()
            for read in self._sources:
                read(True)

    @staticmethod
    def diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
        return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


COUNTERS = Counters()
