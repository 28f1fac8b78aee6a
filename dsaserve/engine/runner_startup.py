"""The start-up side of ModelRunner that no step reads: what a start learns from and leaves for the next start,
and what it reports (startup chain: beside "load weights" up to "Up").

Owns (`RunnerStartup`, a mixin of `engine/model_runner.py: ModelRunner`): the parallel kernel precompile's
start and wait (engine/kernel_precompile.py), the warm-start record — its preload before the first forward, its
memory profile reused (engine/warm_start.py), its save at Up — the memory profile's KV budget
(engine/memory_profile.py), `_mark_up` (compiles and kernel loads counted as after Up from here; this start's
spec list saved), and `manifest()`, what `/startup` and `dsaserve serve` print. Also `PhaseTimer`, which times
each phase into `startup_time`.

Why apart: ModelRunner builds the model and the pool and runs the steps; these parts only look back at a start
(its records, its report), and read the runner's fields without changing how it steps.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import torch

from dsaserve.common import envs
from dsaserve.common.counters import COUNTERS
from dsaserve.common.kv_layout import get_kv_layout
from dsaserve.distributed import collectives
from dsaserve.engine import early_cuda, kernel_precompile
from dsaserve.engine.kv_pool import PAGE_SIZE
from dsaserve.engine.memory_profile import MemoryProfile, profile_memory
from dsaserve.engine.warm_start import WarmStart, config_parts, device_parts, prewarm_triton_key
from dsaserve.kernels.registry import describe as describe_kernels

log = logging.getLogger(__name__)


class PhaseTimer:
    """`with PhaseTimer(sink, phase):` adds the block's seconds to `sink[phase]`."""

    def __init__(self, sink: dict[str, float], phase: str):
        self.sink, self.phase = sink, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.sink[self.phase] = round(self.sink.get(self.phase, 0.0) + time.perf_counter() - self.t0, 4)


class RunnerStartup:
    """Start-up records and report of a ModelRunner; every field it reads is set by ModelRunner.__init__."""

    def _start_precompile(self, device: str) -> None:
        """The recorded kernels compile in parallel while this rank initialises and loads weights (a server's
        scheduler process started it before its imports); waited for before the first forward."""
        cuda = str(device).startswith("cuda")
        self.precompile = kernel_precompile.take_pending() or kernel_precompile.start() if cuda else None
        if cuda:
            prewarm_triton_key()  # Triton's per-process hash, on a thread while this rank initialises and loads

    def _wait_precompile(self) -> None:
        if self.precompile is not None:
            with PhaseTimer(self.startup_time, "kernel_precompile_wait"):
                self.precompile.wait()

    def _mark_up(self) -> None:
        """Up: from here a compile or a kernel load counts as after Up; the start's kernel specs are saved."""
        if self.compile_cache is None:
            return
        self.compile_cache.mark_up()
        self.kernel_loads.mark_up()
        self._save_specs()
        self._save_warm_start()
        COUNTERS.add_source(self.compile_cache.compiles_after_up)
        COUNTERS.add_source(self.kernel_loads.read)

    def _save_specs(self) -> None:
        """This start's kernel specs onto the list the next start precompiles (an unwritable cache: logged)."""
        if not self.spec_recorder.installed:
            return
        try:
            self.spec_recorder.save()
        except OSError as e:
            log.warning("kernel specs not saved to %s: %s", self.spec_recorder.path, e)

    def _jit_loads(self) -> int | None:
        """Triton kernels the JITs compiled or loaded in this process so far (None: not counted)."""
        return self.kernel_loads.count if self.kernel_loads is not None and self.kernel_loads.installed else None

    def _cached_profile(self) -> MemoryProfile | None:
        """The warm-start record's profile, when this start may use it (engine/warm_start.py says when)."""
        if self.warm_start is None:
            return None
        live = {"total_bytes": torch.cuda.mem_get_info(self.device)[1],
                "weights_bytes": torch.cuda.memory_allocated(self.device),
                "mem_fraction_static": self.args.mem_fraction_static, "graph_reserve_bytes": self.graph_reserve_bytes}
        cached = self.warm_start.cached_profile(live)
        return MemoryProfile(**{f.name: cached[f.name] for f in dataclasses.fields(MemoryProfile)}) if cached else None

    def _preload(self) -> WarmStart:
        with PhaseTimer(self.startup_time, "kernel_preload"):
            extra = {"graph_reserve_bytes": self.graph_reserve_bytes, **device_parts(self.device)}
            warm = WarmStart(config_parts(self.args, self.cfg, self.parallel.to_dict(), extra))
            warm.preload(self._jit_loads)
        return warm

    def _save_warm_start(self) -> None:
        """This start's record for the next (only with every graph captured: a start that fell back to eager
        warmed other shapes); kernels loaded after Up are appended to it as they load."""
        if self.warm_start is None or self.graph_errors or not self.spec_recorder.installed:
            return
        profile = dataclasses.asdict(self.profile) if self.profile is not None else None
        try:
            self.warm_start.save(self.spec_recorder.specs, profile)
            self.spec_recorder.mirrors.append(self.warm_start.specs_path)
        except OSError as e:
            log.warning("warm-start record not saved to %s: %s", self.warm_start.dir, e)

    def _profile_memory(self) -> int:
        """The KV budget the memory profile leaves; over ranks the smallest wins (every rank holds the same
        pages, and under DP-attention every rank's pool must take the same requests)."""
        a = self.args
        with PhaseTimer(self.startup_time, "memory_profile"):
            self.profile = self._cached_profile() or profile_memory(
                self.model, self.cfg, get_kv_layout(a.kv_layout), self.dtype, self.device,
                self.model.kv_layer_ids, max(a.chunk_size, a.max_num_batched_tokens),
                # the largest step the scheduler may form: a full token budget, and every running row eager
                max(a.graph_max_bs, a.max_running_requests), a.mem_fraction_static, self.graph_reserve_bytes,
                activation_copies=2 if a.piecewise_tokens and self.dp_sync is None else 1, dp_world=self.dp_world)
        budget = self.profile.kv_budget_bytes
        if self.parallel.world_size > 1:
            t = torch.tensor([budget], dtype=torch.int64, device=self.device)
            budget = int(collectives.all_reduce(t, self.parallel.world, op="min").item())
        return budget

    def _ledger_pool_prediction(self) -> dict:
        """The ledger's arithmetic for this pool, shown beside what was allocated (they must agree)."""
        from dsaserve.ledger.kv import indexer_bytes_per_token_layer, kv_bytes_per_token_layer

        layers = self.model.kv_layer_ids
        n_full = sum(self.cfg.is_full_indexer(i) for i in layers)
        per_token = (kv_bytes_per_token_layer(self.cfg, self.kv_pool.layout) * len(layers)
                     + indexer_bytes_per_token_layer(self.cfg, self.kv_pool.layout) * n_full)
        budget = self.profile.kv_budget_bytes if self.profile else None
        pages = budget // (per_token * PAGE_SIZE) if budget else self.kv_pool.num_pages
        return {"bytes_per_token": per_token, "pages": pages, "tokens": pages * PAGE_SIZE,
                "matches_pool": per_token == self.kv_pool.info().bytes_per_token and pages == self.kv_pool.num_pages}

    def manifest(self) -> dict:
        info = self.kv_pool.info()
        return {"model": self.cfg.name, "model_type": self.cfg.model_type, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "startup_time": dict(self.startup_time),
                "parallel": self.parallel.to_dict() | {"warmed_collectives": self.warmed_collectives}
                | ({"dp_moe": self.args.dp_moe} if self.dp_sync is not None else {}),
                "weights": self.load_report.to_dict(), "kv_pool": info.__dict__,
                "memory_profile": self.profile.to_dict() if self.profile else None,
                "kv_pool_ledger": self._ledger_pool_prediction(),
                "kernels": describe_kernels(self.device),
                "cuda_graph": {"buckets": sorted(self.graphs.graphs) if self.graphs else [],
                               "page_table_widths": self.graphs.widths if self.graphs else [],
                               # classes of batches up to few_row_max_bs rows only (engine/decode_graphs.py)
                               "few_row_page_table_widths": self.graphs.few_row_widths if self.graphs else [],
                               "few_row_max_bs": self.graphs.few_row_max_bs if self.graphs else 0,
                               "inputs_copied_in_graph": self.graphs.copy_in_graph if self.graphs else False,
                               "page_table_on_device_widths": self.graphs.mirrored_widths if self.graphs else [],
                               "max_bs": self.cuda_graph_max_bs if self.graphs else 0,
                               "capture_seconds": round(self.graphs.capture_seconds, 3) if self.graphs else 0,
                               "capture_retries": self.graphs.capture_retries if self.graphs else 0,
                               "error": self.graph_errors.get("decode")},
                "mtp_cuda_graph": {"buckets": sorted(self.mtp_graphs.graphs) if self.mtp_graphs else [],
                                   "capture_seconds": round(self.mtp_graphs.capture_seconds, 3) if self.mtp_graphs
                                   else 0, "error": self.graph_errors.get("mtp")},
                "piecewise_cuda_graph": {
                    "buckets": sorted(self.piecewise.graphs) if self.piecewise else [],
                    "max_tokens": self.piecewise.max_tokens if self.piecewise else 0,  # what routes a step there
                    "segments_per_bucket": self.model.num_segments if self.piecewise else 0,
                    "capture_seconds": round(self.piecewise.capture_seconds, 3) if self.piecewise else 0,
                    "pool_bytes": self.piecewise.capture_bytes if self.piecewise else 0,
                    "capture_retries": self.piecewise.capture_retries if self.piecewise else 0,
                    "error": self.graph_errors.get("piecewise")},
                "gemm_tuning": self.gemm_tuning,
                "warmed_prefill_chunks": self.warmed_prefill,
                "warmed_shapes": self.warmed,
                "compile_cache": self.compile_cache.report() if self.compile_cache else None,
                "kernel_precompile": self._precompile_report(),
                "warm_start": self.warm_start.report() if self.warm_start is not None else None,
                "early_cuda_context": early_cuda.report(),
                "env": envs.set_switches()}

    def _precompile_report(self) -> dict:
        """What the parallel precompile did: its report (wall_s ran beside init / load_weights; only
        `kernel_precompile_wait` is on this rank's path), and the spec list this start recorded."""
        rec = self.spec_recorder
        out: dict[str, Any] = {"status": "off" if not envs.DSASERVE_PRECOMPILE else "no spec list yet"}
        if kernel_precompile.skipped() is not None:  # every listed spec compiled by an earlier start
            out = dict(kernel_precompile.skipped())
        if self.precompile is not None:
            out = {"status": "ran", **(self.precompile.report or {})}
        if rec is not None:
            out["recorded_specs"], out["spec_list"] = len(rec.specs), str(rec.path)
        return out
