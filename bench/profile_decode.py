"""Where a decode step's time goes (issue 5): per-kernel GPU time of one decode step, grouped by kernel.

Run on the device:  PYTHONPATH=. python bench/profile_decode.py --out $OUT [--batches 1,32 --contexts 1024]
For each (batch, context) it times the CUDA-graph replay (what serving runs) and profiles the same step
under torch.profiler, both as a replay and eagerly. The table lists each kernel's µs per step and its
share; "sum of kernels" beside the replay time shows how much of the step is gaps between kernels.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.bench_gpu import cuda_time, decode_bytes, fill_pool, measure_ceilings, pipelined_time
from dsaserve.common import envs
from dsaserve.engine import cuda_graph_runner
from dsaserve.engine.gemm_tuning import tune_model
from dsaserve.engine.memory_profile import dummy_decode
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.kernels import (
    cublaslt_tuning,
    gluon_fp8_splitk,
    gluon_sparse_mla,
    triton_elementwise,
    triton_fp8_gemm,
    triton_head_gemm,
    triton_indexer_coop,
    triton_kv_write,
    triton_moe,
    triton_moe_align,
    triton_moe_route,
    triton_sparse_mla,
    variants,
)
from dsaserve.kernels import reference as R
from dsaserve.kernels.registry import get_ops
from dsaserve.model import glm_moe_dsa
from dsaserve.model.layers import embedding, moe
from dsaserve.model.layers import indexer as indexer_module


def cuda_events(fn, steps: int) -> list:
    """The GPU events of `steps` calls of fn (after one warm call), in launch order."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    return sorted((ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda ev: ev.time_range.start)


def kernel_table(fn, steps: int = 5) -> tuple[list[tuple[str, float, int]], float]:
    """[(kernel name, µs per step, launches per step)] sorted by time, and the summed kernel µs per step."""
    time_us: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for ev in cuda_events(fn, steps):
        time_us[ev.name[:90]] += ev.device_time / steps
        calls[ev.name[:90]] += 1
    rows = sorted(((n, t, calls[n] // steps) for n, t in time_us.items()), key=lambda r: -r[1])
    return rows, sum(t for _, t, _ in rows)


def kernel_sequence(fn, steps: int = 5) -> list[tuple[str, float]]:
    """One step's kernels in launch order, each (name, median µs over `steps` steps): which GEMM is which shape
    follows from the model's order (the grouped table above sums them by name)."""
    evs = cuda_events(fn, steps)
    per = len(evs) // steps
    return [(evs[i].name[:70], statistics.median(evs[i + s * per].device_time for s in range(steps)))
            for i in range(per)]


def kernel_timeline(fn, steps: int = 5) -> dict:
    """One replayed step as a timeline, each launch's median over `steps` steps: its stream, start, duration, and
    what it added to the step (`adds`): its end minus the latest end of any kernel that ended before it. The adds
    sum to the step's span. On one chain of kernels this is each kernel's own cost (under PDL a kernel starts while
    its predecessor runs, its programs waiting in griddepcontrol.wait, so durations overlap; the wait is charged to
    the kernel waited for). Where two streams overlap, an interval goes to the kernel that ended first in it: a
    side-stream kernel beside the compute stream's is charged the part it ended first in, not ~0; an idle gap
    goes to the next kernel to end. Launches are matched across steps by (name, occurrence of that name in the
    step's start order): two streams' kernels that start together may swap places between steps."""
    evs = cuda_events(fn, steps)
    per = len(evs) // steps
    rows: dict[tuple[str, int], dict] = {}
    spans = []
    for s in range(steps):
        step = sorted(evs[s * per:(s + 1) * per], key=lambda ev: ev.time_range.start)
        t0 = step[0].time_range.start
        last, adds = t0, {}
        for i in sorted(range(per), key=lambda i: step[i].time_range.end):
            adds[i], last = max(0.0, step[i].time_range.end - last), max(last, step[i].time_range.end)
        spans.append(last - t0)
        seen: dict[str, int] = defaultdict(int)
        for i, ev in enumerate(step):
            name = ev.name[:70]
            key = (name, seen[name])
            seen[name] += 1
            row = rows.setdefault(key, {"name": name, "stream": ev.device_resource_id, "start": [], "dur": [],
                                        "adds": []})
            for field, v in (("start", ev.time_range.start - t0), ("dur", ev.device_time), ("adds", adds[i])):
                row[field].append(v)
    launches = sorted(rows.values(), key=lambda r: statistics.median(r["start"]))
    for r in launches:
        for field in ("start", "dur", "adds"):
            r[field] = statistics.median(r[field])
    return {"span_us": statistics.median(spans), "launches": launches}


def print_timeline(tl: dict, top: int) -> None:
    """The timeline's kernels grouped by name: launches, summed duration and summed `adds` (the step's cost)."""
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for r in tl["launches"]:
        g = groups[r["name"][:60]]
        g[0] += 1
        g[1] += r["dur"]
        g[2] += r["adds"]
    streams = sorted({r["stream"] for r in tl["launches"]})
    print(f"timeline: span {tl['span_us']:.1f} us, {len(tl['launches'])} launches on streams {streams}")
    print(f"{'adds us':>9} {'dur us':>9} {'n':>4}  kernel")
    for name, (n, dur, add) in sorted(groups.items(), key=lambda kv: -kv[1][2])[:top]:
        print(f"{add:9.1f} {dur:9.1f} {n:4d}  {name}")


def _dsaserve_frame(ev) -> str:
    """The innermost dsaserve line of an op: from its recorded stack, else its parents' Python-function events."""
    frame = next((f for f in ev.stack if "dsaserve/" in f), None)
    parent = ev.cpu_parent
    while frame is None and parent is not None:
        frame = parent.name if "dsaserve/" in parent.name else None
        parent = parent.cpu_parent
    return (frame or "?").split("dsaserve/")[-1]


def kernel_sources(fn, pattern: str, top: int = 12) -> list[dict]:
    """Which torch ops launched the kernels whose name matches `pattern` in one call: each (op, input shapes, the
    innermost dsaserve frame of its Python stack) with its kernels' ms and count, dearest first."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True,
                 with_stack=True) as prof:
        fn()
        torch.cuda.synchronize()
    found: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        for kern in ev.kernels:
            if re.search(pattern, kern.name):
                frame = _dsaserve_frame(ev)
                entry = found[(ev.name, str(ev.input_shapes)[:160], frame)]
                entry[0] += kern.duration / 1e3
                entry[1] += 1
    rows = sorted(found.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"op": op, "shapes": shapes, "at": at, "ms": ms, "kernels": int(n)} for (op, shapes, at), (ms, n) in rows]


def host_phases(runner, batch, reps: int = 30) -> dict[str, float]:
    """Median host µs of a replayed step's parts: the batch checks, staging (+ the H2D copy call when it is
    not inside the graph) and the graph launch call: the GPU idles through them in a synchronous step. Each rep
    starts after a sync, so no launch queue is full."""
    g = runner.graphs.runner_for(batch)  # the width class the batch replays
    bs = batch.batch_size
    bucket = next(b for b in g.buckets if b >= bs)
    times: dict[str, list[float]] = defaultdict(list)
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        g.fallback_reason(batch)
        t1 = time.perf_counter()
        g._load_host(batch, bs, bucket)
        t2 = time.perf_counter()
        g.graphs[bucket].graph.replay()
        t3 = time.perf_counter()
        for name, dt in (("check", t1 - t0), ("stage", t2 - t1), ("graph_launch", t3 - t2)):
            times[name].append(dt * 1e6)
    torch.cuda.synchronize()
    return {name: statistics.median(v) for name, v in times.items()}


def _key_values(spec: str) -> dict:
    """"k=v/k=v" -> {k: v}, integer values as int."""
    return {k: int(v) if v.lstrip("-").isdigit() else v for k, v in (kv.split("=", 1) for kv in spec.split("/"))}


def _override(table: dict, conf: dict):
    """Update a module's config dict in place; return the undo."""
    old = dict(table)
    table.update(conf)
    return lambda: (table.clear(), table.update(old))


def _set(module, **values):
    """Set a module's attributes; return the undo."""
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    return lambda: [setattr(module, k, v) for k, v in old.items()]


def ab_setting(runner, name: str):
    """Apply one --ab setting to the runner's GPU ops or model and return its undo: "default" nothing,
    "cublas_small" the indexer's weights_proj on cuBLAS (not `small_linear`'s GEMV), "unfused_knorm" the
    indexer key's LayerNorm (torch), RoPE and write as three launches (not `indexer_k_norm_write`),
    "shared_apart" the shared expert as its own GEMMs in the step's chain (not one more expert of `fused_moe`, nor
    on the side stream), "select_launches" the
    long-row select as its 7-8 launches (not the one cooperative launch of 1-2 rows; implies "score_apart"),
    "score_apart" the FP8 cache's 1-2 long rows scored by their own launch before the cooperative select (not
    both in one launch), "no_fold" sparse MLA's split
    combine as its own launch (not merged by W_uv's head GEMM), "fp8_single" the fp8 cache's 16+ token calls on the
    single-partition Gluon kernel (not the decode schedule, `gluon_sparse_mla.FP8_DEFAULT`), "moe_swap" busy experts'
    decode MoE on the swap-AB kernel (not `triton_moe.BUSY_CONFIG`), "count_inline" the experts-touched count in
    the step's chain (not on the side stream), "count_off" no experts-touched count on the GPU (what it costs;
    the counters then miss it), "router_cublas" the router and weights_proj of 33-256 tokens on
    cuBLAS (not the split-K tiles), "mla1:k=v/k=v" one token's sparse MLA tile overridden
    (`triton_sparse_mla.ONE_TOKEN_CONFIG`: block_h, block_k, num_warps, num_stages, scan, grouped, splits),
    "wide_graphs" every batch replaying the decode graphs captured at max_model_len's page-table width (not the
    narrowest width class that holds it, engine/decode_graphs.py), "fp32_head" float32 logits out of the lm_head's
    GEMM (DSASERVE_FP32_LM_HEAD=1), not bf16 logits, "float_logits" bf16 logits copied to float32 in the step (the
    lm_head before the thirty-second session, `embedding.FLOAT_COPY`), "busy:k=v/k=v" busy experts' decode MoE
    tiles overridden (`triton_moe.BUSY_CONFIG`; g2_-prefixed keys GEMM2's own, e.g. busy:g2_block_n=64),
    "align_launches" the expert sort of up to 2048 pairs as its four launches (not `_align_one_kernel`),
    "shared_inline" an unfused shared expert (batch 33+) in the step's chain (not on the side stream),
    "quant:k=v/k=v" the activation quantiser's tile (`triton_fp8_gemm.QUANT_TILE`: rows, groups a program),
    "idx_queries" a batch within the top-k computing its indexer queries anyway
    (`indexer.SKIP_QUERIES_FOR_ALL_KEYS`), "q_rope_apart" q's RoPE (sparse MLA's and the indexer's) as their own
    launches (not in the KV writes' launches), "q_rope_serial" q's RoPE blocks rotated by the KV write's own program
    in turn (not programs beside it, `triton_kv_write.Q_ROPE_PROGRAMS`), "select_fill" each cooperative selection
    on a zeroed workspace of its own, a fill launch before it (not the shared one its programs leave zero,
    `triton_indexer_coop.SHARED_WORKSPACE`), "coop_barriers" each round of the cooperative selects behind a barrier,
    then its histogram read (not the histogram polled until complete, `triton_indexer_coop.HIST_POLL`),
    "coop_count_barrier" their counts behind a barrier, then read (not polled as tagged words, `COUNT_POLL`),
    "coop_q_first_off" the fused one's q rounded before its keys are read, scores through memory (`KEYS_FIRST`),
    "fold_in_block" W_uv's fold loading each K block's split partials in that block (not a block ahead,
    `triton_head_gemm.FOLD_PREFETCH`), "split_sum_serial" the split GEMV's last program loading the parts one at a
    time (not four at once, `triton_fp8_gemm.SPLIT_PARTS_AT_ONCE`),
    "copy_for_cublas" / "no_copy_for_cublas" 33-512-row RMSNorm / SiLU outputs carrying their FP8 copy in both
    scale layouts, so the cuBLAS projections and the MoE do not quantise them, or not (the quantiser launch before
    each: `triton_fp8_gemm.CUBLAS_COPY_MAX_ROWS`, 512 by default since the forty-third session),
    "splitk" / "no_splitk" the 33-64-row projections that split K on the warp-specialised split-K GEMM or all on
    cuBLAS (`triton_fp8_gemm.SPLITK_GEMM`), "splitk128" the split-K GEMM up to 128 rows (SPLITK_ROWS),
    "splitk:k=v/k=v" its variant (regs, stages, pdl: `gluon_fp8_splitk.CONSUMER_REGS`, STAGES, PDL; rows:
    SPLITK_ROWS' upper end), "fused64" the fused score + select of 1-2 long rows over at most 64
    programs (`variants.FUSED_PROGRAMS`, 128), "fused132" over up to 132 (the H100's and H200's SM count: its
    few-row decode graph classes move to 528 / 1,056 pages, so the A/B rebuilds the classes: `REBUILDS`),
    "copy_node" the graphs' inputs by a copy node (not a kernel reading the pinned staging buffer,
    `triton_elementwise.HOST_READ_MAX_BYTES`), "full_table"
    every class's whole page table copied each step (not only its changes into the requests' pages kept on the device,
    `cuda_graph_runner.TABLE_MIRROR`), "no_staged_event" the graphs without the external event recorded after their
    input copy (`cuda_graph_runner.STAGED_EVENT`; timing only: the host then restages without waiting),
    "one_stream" the step's kernels all on one stream (DSASERVE_OVERLAP_INDEXER=0: the full layers' selection and the
    experts-touched count in the chain, not on the side stream; with no_staged_event a graph without a branch),
    "prologue_apart" the step's embedding and RoPE rows by two `index_select`s (not one `embed_rope_rows` launch,
    `glm_moe_dsa.FUSED_PROLOGUE`), "norm_weight_late" RMSNorm's weight (the decoder's norms', the MLA KV write's)
    read after the PDL wait (not before, `triton_elementwise.NORM_WEIGHT_FIRST`), "route_weights_first" the router
    GEMV's weight rows and moe_route's bias read before it (not after, `triton_moe_route.WEIGHTS_FIRST`),
    "lt_tuned" the 33-512-row cuBLAS projections on the cuBLASLt algorithm
    timed fastest for their shape and row class (`cublaslt_tuning`, timed at the first use of the setting where the
    engine started without it), not `_scaled_mm`'s own; "lt_off" torch's own choices. "a+b" takes both settings."""
    ops = get_ops(runner.device)
    saved = dict(vars(ops))
    env_settings = {"fp32_head": {"DSASERVE_FP32_LM_HEAD": "1"}, "one_stream": {"DSASERVE_OVERLAP_INDEXER": "0"}}
    if name in env_settings:
        stack = contextlib.ExitStack()
        stack.enter_context(envs.override(**env_settings[name]))
        return stack.close
    module_flags = {"select_launches": (triton_indexer_coop, "COOP_ROWS", 0),
                    "moe_swap": (triton_moe, "BUSY_EXPERT_PAIRS", 1 << 30),
                    "count_inline": (moe, "COUNT_BESIDE", False),
                    "count_off": (moe, "COUNT_ON_DEVICE", False),
                    "router_cublas": (triton_moe_route, "TILE_GEMM_MAX_T", 0),
                    "score_apart": (triton_indexer_coop, "FUSED_ROWS", 0),
                    "no_fold": (triton_sparse_mla, "FOLD_MAX_T", 0),
                    "fp8_single": (gluon_sparse_mla, "FP8_DEFAULT", "single"),
                    "align_launches": (triton_moe_align, "ONE_LAUNCH_PAIRS", 0),
                    "idx_queries": (indexer_module, "SKIP_QUERIES_FOR_ALL_KEYS", False),
                    "float_logits": (embedding, "FLOAT_COPY", True),
                    "q_rope_serial": (triton_kv_write, "Q_ROPE_PROGRAMS", False),
                    "select_fill": (triton_indexer_coop, "SHARED_WORKSPACE", False),
                    "coop_barriers": (triton_indexer_coop, "HIST_POLL", False),
                    "coop_count_barrier": (triton_indexer_coop, "COUNT_POLL", False),
                    "coop_q_first_off": (triton_indexer_coop, "KEYS_FIRST", False),
                    "fold_in_block": (triton_head_gemm, "FOLD_PREFETCH", False),
                    "split_sum_serial": (triton_fp8_gemm, "SPLIT_PARTS_AT_ONCE", False),
                    "copy_for_cublas": (triton_fp8_gemm, "CUBLAS_COPY_MAX_ROWS", 512),
                    "no_copy_for_cublas": (triton_fp8_gemm, "CUBLAS_COPY_MAX_ROWS", 0),
                    "splitk": (triton_fp8_gemm, "SPLITK_GEMM", True),
                    "no_splitk": (triton_fp8_gemm, "SPLITK_GEMM", False),
                    "fused64": (variants, "FUSED_PROGRAMS", 64),
                    "fused132": (variants, "FUSED_PROGRAMS", 132),
                    "copy_node": (triton_elementwise, "HOST_READ_MAX_BYTES", 0),
                    "full_table": (cuda_graph_runner, "TABLE_MIRROR", False),
                    "no_staged_event": (cuda_graph_runner, "STAGED_EVENT", False),
                    "prologue_apart": (glm_moe_dsa, "FUSED_PROLOGUE", False),
                    "norm_weight_late": (triton_elementwise, "NORM_WEIGHT_FIRST", False),
                    "route_weights_first": (triton_moe_route, "WEIGHTS_FIRST", True),
                    "lt_off": (cublaslt_tuning, "TUNED", False)}
    if name == "lt_tuned":
        if not cublaslt_tuning.TIMED:
            report = tune_model(runner.model, runner.device, max_rows=128)
            print("cublaslt tuning:", json.dumps(report), flush=True)
        return _set(cublaslt_tuning, TUNED=True)
    if name == "splitk128":  # the split-K GEMM at 33-128 rows (not only to 64)
        name = "splitk:rows=128"
    if name.startswith("splitk:"):  # e.g. splitk:pdl=0/rows=128/stages=6: the split-K GEMM's variant
        conf = _key_values(name[7:])
        rows = conf.pop("rows", triton_fp8_gemm.SPLITK_ROWS[1])
        undo = [_set(triton_fp8_gemm, SPLITK_ROWS=(triton_fp8_gemm.SMALL_M + 1, rows))]
        keys = {"regs": "CONSUMER_REGS", "stages": "STAGES", "pdl": "PDL"}
        undo.append(_set(gluon_fp8_splitk, **{keys[k]: v for k, v in conf.items()}))
        return lambda: [u() for u in reversed(undo)]
    if name == "wide_graphs":  # every batch on the graphs captured at max_model_len's width
        runner.graphs.runner_for = lambda batch, bucket=None: runner.graphs.widest
        return lambda: vars(runner.graphs).pop("runner_for")
    if name.startswith("mla1:"):  # e.g. mla1:grouped=dequant/block_h=16/num_warps=8: one token's sparse MLA tile
        return _override(triton_sparse_mla.ONE_TOKEN_CONFIG, _key_values(name[5:]))
    if name.startswith("quant:"):  # e.g. quant:rows=1/groups=16: the activation quantiser's program tile
        return _override(triton_fp8_gemm.QUANT_TILE, _key_values(name[6:]))
    if name.startswith("busy:"):  # e.g. busy:num_stages=3/g2_block_n=64: busy experts' decode MoE tiles
        conf = _key_values(name[5:])
        gemm2 = {k[3:]: conf.pop(k) for k in list(conf) if k.startswith("g2_")}
        gemm2 = {**triton_moe.BUSY_CONFIG.get("gemm2", {}), **gemm2}
        return _override(triton_moe.BUSY_CONFIG, {**conf, **({"gemm2": gemm2} if gemm2 else {})})
    if name in module_flags:
        module, attr, value = module_flags[name]
        return _set(module, **{attr: value})
    if name == "cublas_small":
        ops.small_linear = R.small_linear
    elif name == "unfused_knorm":
        def apart(cache, layout, slots, k_raw, weight, bias, eps, cos, sin, rope, interleaved, q=None):
            if q is not None:
                ops.rope_inplace(q[..., :rope], cos, sin, interleaved)
            k = torch.nn.functional.layer_norm(k_raw, (k_raw.shape[-1],), weight, bias, eps)
            ops.rope_inplace(k[..., :rope], cos, sin, interleaved)
            saved["indexer_k_write"](cache, layout, slots, k)
        ops.indexer_k_norm_write = apart
    elif name == "q_rope_apart":
        def mla_apart(cache, layout, slots, kv_a, weight, eps, cos, sin, kv_lora, q_rope=None):
            if q_rope is not None:
                ops.rope_inplace(q_rope, cos, sin, True)
            return saved["mla_kv_write"](cache, layout, slots, kv_a, weight, eps, cos, sin, kv_lora)

        def index_apart(cache, layout, slots, k_raw, weight, bias, eps, cos, sin, rope, interleaved, q=None):
            if q is not None:
                ops.rope_inplace(q[..., :rope], cos, sin, interleaved)
            saved["indexer_k_norm_write"](cache, layout, slots, k_raw, weight, bias, eps, cos, sin, rope, interleaved)
        ops.mla_kv_write, ops.indexer_k_norm_write = mla_apart, index_apart
    elif name == "shared_inline":
        base = saved["fused_moe"]
        ops.fused_moe = functools.partial(base, config={**getattr(base, "keywords", {}).get("config", {}),
                                                        "shared_beside": False})
    elif name == "shared_apart":
        base = saved["fused_moe"]  # the registry's own partial (bf16 activations) keeps its config
        ops.fused_moe = functools.partial(base, config={**getattr(base, "keywords", {}).get("config", {}),
                                                        "fuse_shared": False, "shared_beside": False})
    elif name != "default":
        raise SystemExit(f"--ab: unknown setting {name!r} (default, cublas_small, unfused_knorm, q_rope_apart, "
                         f"shared_apart, shared_inline, fp32_head, one_stream, {', '.join(module_flags)})")
    return lambda: vars(ops).update(saved)


# settings that change which decode graph classes a runner has: with one of them in an A/B, every setting's turn
# rebuilds the classes (`ModelRunner._capture_decode`), not only captures the runner's graphs again
REBUILDS = ("fused132", "full_table")  # full_table: a runner sizes its staged inputs when it is made


def _recapture(runner, rebuild: bool) -> None:
    if rebuild:
        runner.graphs = None  # the old classes' graphs go before the new ones are captured
        torch.cuda.empty_cache()
        runner.graphs = runner._capture_decode()
    else:
        runner.graphs.capture()


def ab_replays(runner, batch, settings: list[str], rounds: int = 3) -> dict[str, list[float]]:
    """ms of the replayed step under each setting, synchronous and back to back ("<setting> overlapped"), in one
    process: the graphs captured again for each (the classes rebuilt where a setting is in REBUILDS), the settings
    taken in turn `rounds` times (a drift of the machine spreads over all of them)."""
    times: dict[str, list[float]] = defaultdict(list)
    parts = {part for name in settings for part in name.split("+")}
    rebuild = bool(parts & set(REBUILDS))
    if rebuild and "wide_graphs" in parts:  # its patch would sit on the classes the rebuild replaces
        raise ValueError(f"--ab: wide_graphs cannot share an A/B with {sorted(parts & set(REBUILDS))}")
    for _ in range(rounds):
        for name in settings:
            undos = [ab_setting(runner, part) for part in name.split("+")]  # "a+b": both settings at once
            try:
                _recapture(runner, rebuild)
                times[name].append(cuda_time(lambda: runner.forward(batch)) * 1e3)
                times[f"{name} overlapped"].append(pipelined_time(lambda: runner.forward(batch)) * 1e3)
            finally:
                for undo in reversed(undos):
                    undo()
    _recapture(runner, rebuild)
    return dict(times)


def profiled(runner, batch, case: dict, args) -> None:
    """A case's kernel tables (replayed and eager), and with the flags its timeline, launch sequence and sources:
    what needs torch's profiler (after every case's timings: `main`). Prints the case."""
    step, piped, bound = case["replay_ms"] / 1e3, case["pipelined_ms"] / 1e3, case["roofline_ms"] / 1e3
    replay_rows, replay_sum = kernel_table(lambda b=batch: runner.forward(b))
    on_device = batch.to(runner.device)
    eager_rows, eager_sum = kernel_table(lambda b=on_device: runner.model(b, runner.kv_pool))
    case.update(replay_kernel_sum_ms=replay_sum / 1e3, eager_kernel_sum_ms=eager_sum / 1e3,
                replay_kernels=replay_rows, eager_kernels=eager_rows)
    print(f"\n== bs {case['bs']} ctx {case['ctx']}: replay {step * 1e3:.3f} ms, roofline {bound * 1e3:.3f} ms "
          f"({step / bound:.2f}x); back-to-back {piped * 1e3:.3f} ms ({piped / bound:.2f}x); "
          f"kernels in replay {replay_sum / 1e3:.3f} ms, eager {eager_sum / 1e3:.3f} ms")
    print("host before the GPU starts (µs):", {k: round(v, 1) for k, v in case["host_us"].items()})
    rows = replay_rows if replay_rows else eager_rows
    print(f"{'us/step':>9} {'n':>4}  kernel ({'replay' if replay_rows else 'eager'})")
    for name, t, n in rows[: args.top]:
        print(f"{t:9.1f} {n:4d}  {name}")
    if "ab" in case:
        print("A/B replay ms:", {k: [round(v, 4) for v in vs] for k, vs in case["ab"].items()})
    if args.timeline:
        case["timeline"] = kernel_timeline(lambda b=batch: runner.forward(b))
        print_timeline(case["timeline"], args.top)
    if args.sequence:
        case["sequence"] = kernel_sequence(lambda b=on_device: runner.model(b, runner.kv_pool))
    if args.sources:
        case["sources"] = kernel_sources(lambda b=on_device: runner.model(b, runner.kv_pool), args.sources)
        for src in case["sources"]:
            print(f"  {src['ms'] * 1e3:8.1f} us {src['kernels']:4d}x  {src['op']} {src['shapes']}  at {src['at']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="glm-5.3-slice")
    ap.add_argument("--out", default="profile-out")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--sources", default="", help="a regex of kernel names: print the torch ops of an eager step "
                    "that launched them (the aten kernels of a replayed graph break its PDL chain)")
    ap.add_argument("--ab", default="", help="settings to time in turn, one process (`ab_setting`): default,"
                    "cublas_small,unfused_knorm,shared_apart,select_launches,no_fold,fp8_single,moe_swap,count_inline,"
                    "router_cublas,mla1:k=v/k=v,busy:k=v/k=v,align_launches,shared_inline,wide_graphs,"
                    "fp32_head,idx_queries,quant:k=v/k=v")
    ap.add_argument("--sequence", action="store_true", help="also record an eager step's kernels in launch order")
    ap.add_argument("--timeline", action="store_true", help="also record a replayed step's kernels: stream, start, "
                    "duration and what each added to the step")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    ceilings = measure_ceilings()
    pages = max(batches) * -(-(max(contexts) + 1) // 64) + 16
    runner = ModelRunner.from_kwargs(args.config, dtype="bfloat16", load_format="dummy", device="cuda", num_pages=pages,
                         cuda_graph_max_bs=max(batches), max_model_len=max(contexts) + 64, chunked_prefill_size=2048)
    fill_pool(runner.kv_pool, runner.cfg)
    report = {"ceilings": ceilings, "impls": runner.manifest().get("kernels"), "cases": []}
    # Every case's timings first: once torch's profiler has run in a process, CUPTI stays attached and each graph
    # launch costs the host more (the H200's b1 launch: 31 us before, 140 after), so a synchronous step timed after
    # a profiled case ran 200 us slower than its back-to-back one (bench/RESULTS.md, twenty-fifth session)
    cases = [(bs, ctx, dummy_decode(bs, ctx, runner.page_size, "cpu", runner.cfg.vocab_size))  # host batches
             for ctx in contexts for bs in batches]
    for bs, ctx, batch in cases:
        step = cuda_time(lambda b=batch: runner.forward(b))
        piped = pipelined_time(lambda b=batch: runner.forward(b))
        bound = decode_bytes(runner, bs, ctx)["total"] / ceilings["copy_bytes_per_s"]
        case = {"bs": bs, "ctx": ctx, "replay_ms": step * 1e3, "pipelined_ms": piped * 1e3,
                "host_us": host_phases(runner, batch), "roofline_ms": bound * 1e3}
        if args.ab:
            case["ab"] = ab_replays(runner, batch, args.ab.split(","))
            print(f"A/B bs {bs} ctx {ctx} (ms):", {k: [round(v, 4) for v in vs] for k, vs in case["ab"].items()},
                  flush=True)  # now: a call cut short by its limit still returns the cases timed
        report["cases"].append(case)
    for (_, _, batch), case in zip(cases, report["cases"], strict=True):
        profiled(runner, batch, case, args)
    (out / "profile_decode.json").write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
