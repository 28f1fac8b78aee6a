"""Reconcile: the ledger's prediction for a run next to what the engine's counters measured, per term.

Owns: (a) `predict_run` — a pure model of one offline run (prompts, max_tokens, scheduler limits, KV
layout, TP) replaying the scheduler's step policy (engine/scheduler.py: decodes first, then prompts in
chunks under the token budget) and summing, per forward, the terms common/counters.py counts; (b)
`reconcile` — predicted vs measured rows (ratio, tolerance, ok); (c) `load_run` — a saved run file
({"config", "deployment", "workload", "counters", "kv_pool"}) with errors naming the field. Counts
(forwards, collective calls, pool pages and tokens) must match exactly; bytes match exactly where the
prediction is deterministic and within stated bounds where routing decides (routed experts). Pure Python:
the engine driver lives in cli/reconcile_driver.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsaserve.common.causal import (
    STAGING_MIN_TOKENS,
    STAGING_ROWS_PER_TOKEN,
    indexer_skips,
    keys_scored,
    staged_row_bytes,
    staged_rows,
    stages_latent,
    table_pages,
    topk_selected,
)
from dsaserve.common.counters import is_counter_name
from dsaserve.common.kv_layout import DEFAULT_KV_LAYOUT, get_kv_layout
from dsaserve.config import ModelConfig, load_config
from dsaserve.kernels.variants import core_width
from dsaserve.ledger.collective_plan import step_plan
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.ledger.kv import indexer_bytes_per_token_layer, kv_bytes_per_token_layer
from dsaserve.ledger.weights import divisor, experts_touched_fraction, group_of, inventory, query_bytes_per_gpu
from dsaserve.weights.spec import checkpoint_specs

ACT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
RUN_EXTRA = ("engine_stats", "device")  # what cli/reconcile_driver records beside the run (RunRecord.extra)
RUN_FIELDS = ("config", "deployment", "workload", "counters", "kv_pool", *RUN_EXTRA)
_NORM_SUFFIXES = ("layernorm.weight", "norm.weight", "k_norm.weight", "k_norm.bias")


@dataclass(frozen=True)
class RunShape:
    """What a run did, as far as the prediction needs it."""

    prompt_lens: tuple[int, ...]
    max_tokens: int
    kv_layout: str = DEFAULT_KV_LAYOUT
    dtype: str = "float32"
    tp: int = 1
    ep: int = 1
    dp_attention: bool = False
    page_size: int = 64
    max_num_batched_tokens: int = 2048
    chunked_prefill_size: int | None = None
    max_running_requests: int = 128
    sink_pages: int = 0  # pool pages no request owns (CUDA: one page the graph's padding rows write to)
    prefill_staging: bool = False  # the run's kernels stage large prefills' rows as bf16 (GPU ops, switch on)
    # CUDA graphs, which fix the page-table width a forward runs at (none: every step eager at its batch's width):
    decode_graph_widths: tuple[int, ...] = ()  # the decode graphs' width classes, pages
    decode_graph_max_bs: int = 0  # requests up to which a decode step replays them
    segment_tokens: int = 0  # the largest piecewise bucket: a step with a prefill part up to it runs as segments

    def __post_init__(self) -> None:
        if not self.prompt_lens or any(not isinstance(p, int) or p < 1 for p in self.prompt_lens):
            raise ValueError(f"workload.prompt_lens: need positive integers, got {self.prompt_lens!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"workload.max_tokens: need a positive integer, got {self.max_tokens!r}")
        get_kv_layout(self.kv_layout, "workload.kv_layout", engine=False)
        if self.dtype not in ACT_BYTES:
            raise ValueError(f"workload.dtype: {self.dtype!r} not one of {', '.join(ACT_BYTES)}")
        if any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.decode_graph_widths):
            raise ValueError(f"workload.decode_graph_widths: need positive integers, got {self.decode_graph_widths!r}")
        for name in ("decode_graph_max_bs", "segment_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"workload.{name}: need a non-negative integer, got {v!r}")

    @property
    def chunk(self) -> int:
        return self.chunked_prefill_size or self.max_num_batched_tokens

    def forward_width(self, rows: list[Row]) -> tuple[int, bool]:
        """`graph_width` of a forward of these rows in this run."""
        return graph_width(table_pages([r.prefix + r.new for r in rows], self.page_size), all(r.new == 1 for r in rows),
                           len(rows), sum(r.new for r in rows), self.decode_graph_widths, self.decode_graph_max_bs,
                           self.segment_tokens)


def graph_width(pages: int, decode: bool, rows: int, tokens: int, decode_widths: tuple[int, ...] | list[int],
                decode_max_bs: int, segment_tokens: int) -> tuple[int, bool]:
    """(the page-table width a forward runs at, whether it runs as piecewise segments), as `engine/model_runner.route`
    sends it: a decode step (every row one token) of at most decode_max_bs rows to the narrowest decode graph class
    that holds its `pages` (engine/decode_graphs.py); else, up to segment_tokens tokens, to the piecewise graphs at
    the core's padded width (engine/piecewise_runner.py; decode steps the decode graphs do not take too); else
    eagerly at its own width (engine/batch.py). The decode graphs' few-row classes (1-2 rows at 32K / 64K keys) are
    not modelled: each is wider than the top-k, so a step replaying one counts what the next wider class counts."""
    if decode and rows <= decode_max_bs:
        fits = [w for w in decode_widths if w >= pages]
        if fits:
            return min(fits), False
    if tokens <= segment_tokens:
        return core_width(pages), True
    return pages, False


@dataclass(frozen=True)
class Row:
    prefix: int  # tokens of the request already in KV
    new: int  # tokens computed this forward


def simulate_schedule(shape: RunShape) -> list[list[Row]]:
    """Forwards of a run whose requests all arrive together (Engine.generate), no preemption, no prefix hit."""
    n = len(shape.prompt_lens)
    computed, generated = [0] * n, [0] * n
    running: list[int] = []
    waiting = list(range(n))
    steps: list[list[Row]] = []
    while running or waiting:
        left, rows, take = shape.max_num_batched_tokens, [], {}
        decoding = [r for r in running if computed[r] >= shape.prompt_lens[r]]
        prompting = [r for r in running if computed[r] < shape.prompt_lens[r]]
        for r in decoding + prompting:
            pending = shape.prompt_lens[r] + generated[r] - computed[r]
            k = min(pending, shape.chunk, left)
            if k > 0:
                take[r], left = k, left - k
        while waiting and left > 0 and len(running) < shape.max_running_requests:
            r = waiting.pop(0)
            running.append(r)
            take[r] = min(shape.prompt_lens[r], shape.chunk, left)
            left -= take[r]
        for r, k in take.items():
            rows.append(Row(computed[r], k))
            computed[r] += k
            if computed[r] == shape.prompt_lens[r] + generated[r]:  # all pending computed: a token is sampled
                generated[r] += 1
                if generated[r] == shape.max_tokens:
                    running.remove(r)
        steps.append(rows)
    return steps


@dataclass(frozen=True)
class Predicted:
    value: float
    lo: float  # accepted measured range (lo == hi == value for exact terms)
    hi: float
    why: str

    @property
    def exact(self) -> bool:
        return self.lo == self.hi


def _exact(v: float, why: str) -> Predicted:
    return Predicted(v, v, v, why)


def fixed_weight_bytes(cfg: ModelConfig, dep: Deployment | None = None) -> tuple[float, float]:
    """(bytes one rank reads every forward outside the routed experts, one routed expert's bytes on that rank):
    every GEMM weight + scale of the main layers, router weight + bias and the lm_head, each at the rank's share
    (weights.divisor); not the embedding (a gather), not 1-D norm weights, not the MTP layer (speculation off)."""
    dep = dep or Deployment(tp=1)
    asm = Assumptions()
    mtp = tuple(f"model.layers.{i}." for i in cfg.mtp_layer_ids)
    fixed = expert = 0.0
    first_moe = cfg.moe_layers[0] if cfg.moe_layers else -1
    for t in checkpoint_specs(cfg):
        if t.name.startswith(mtp) or t.name.startswith("model.embed_tokens.") or t.name.endswith(_NORM_SUFFIXES):
            continue
        if ".mlp.experts." in t.name:
            if t.name.startswith(f"model.layers.{first_moe}.mlp.experts.0."):
                expert += t.nbytes / (1 if dep.ep > 1 else dep.tp)  # EP: whole experts; TP: 1/TP of each
            continue
        fixed += t.nbytes / divisor(group_of(t.name), dep, asm)
    return fixed, expert


def query_weight_bytes(cfg: ModelConfig, dep: Deployment | None = None) -> float:
    """Of `fixed_weight_bytes`, the full indexer layers' query projections (wq_b, weights_proj): a forward whose page
    table is within the top-k does not read them (`common/causal.takes_every_key`) unless it runs as segments."""
    return query_bytes_per_gpu(inventory(cfg), dep or Deployment(tp=1), Assumptions()).get("indexer", 0)


def _indexer_skips(cfg: ModelConfig, shape: RunShape, rows: list[Row]) -> tuple[bool, bool]:
    """`common/causal.indexer_skips` of a forward of these rows at the width it runs at (the engine counts the same)."""
    pages, segments = shape.forward_width(rows)
    return indexer_skips(pages, shape.page_size, cfg.index_topk, segments)


def predict_run(cfg: ModelConfig, shape: RunShape, experts_touched: float | None = None) -> dict[str, Predicted]:
    """Every counter of common/counters.py this run bumps, predicted from the config and the shape.

    `experts_touched` (the engine's `moe_experts_touched` counter, if it keeps one: distinct routed experts
    summed over MoE layers and forwards) makes the weight-byte prediction exact instead of a routing range."""
    steps = simulate_schedule(shape)
    kv_bpt = kv_bytes_per_token_layer(cfg, shape.kv_layout)
    idx_bpt = indexer_bytes_per_token_layer(cfg, shape.kv_layout)
    n_kv, n_full = cfg.num_hidden_layers, len(cfg.full_indexer_layers)
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    tokens = [sum(r.new for r in s) for s in steps]
    written = sum(tokens)
    selected = sum(topk_selected(r.prefix, r.new, cfg.index_topk) for s in steps for r in s)
    every = [_indexer_skips(cfg, shape, s) for s in steps]
    scored = sum(keys_scored(r.prefix, r.new) for s, (no_keys, _) in zip(steps, every, strict=True) for r in s
                 if not no_keys)
    dep = Deployment(tp=shape.tp, ep=shape.ep, dp_attention=shape.dp_attention)
    fixed, expert = fixed_weight_bytes(cfg, dep)
    queries = query_weight_bytes(cfg, dep)
    fixed_all = sum(fixed - (queries if no_queries else 0) for _, no_queries in every)
    skipped = sum(no_queries for _, no_queries in every)
    n_moe, local = len(cfg.moe_layers), e // shape.ep  # experts one rank can read
    expect = fixed_all + sum(n_moe * expert * local * experts_touched_fraction(cfg, t, "uniform") for t in tokens)
    lo = fixed_all + sum(n_moe * expert * (min(k, e) if shape.ep == 1 else 0) for t in tokens)
    hi = fixed_all + sum(n_moe * expert * min(local, t * k) for t in tokens)
    if experts_touched is not None:
        expect = lo = hi = fixed_all + experts_touched * expert
    out = {
        "forward_steps": _exact(len(steps), f"{len(steps)} forwards: scheduler replay (budget "
                                f"{shape.max_num_batched_tokens}, chunk {shape.chunk})"),
        "kv_bytes_written": _exact(written * kv_bpt * n_kv, f"{written} tokens x {kv_bpt} B x {n_kv} layers"),
        "indexer_bytes_written": _exact(written * idx_bpt * n_full, f"{written} tokens x {idx_bpt} B x {n_full} "
                                        "full layers"),
        "kv_bytes_read": _exact(selected * kv_bpt * n_kv, f"{selected} selected slots (min(top-k, pos+1) per "
                                f"query) x {kv_bpt} B x {n_kv} layers"),
        "indexer_bytes_read": _exact(scored * idx_bpt * n_full, f"{scored} causal keys scored x {idx_bpt} B x "
                                     f"{n_full} full layers (none in the {sum(n for n, _ in every)} forwards within "
                                     f"the top-k)"),
        "weight_bytes_read": Predicted(expect, lo, hi, f"per forward {fixed:,.0f} B fixed ({queries:,.0f} B of indexer "
                                       f"queries fewer in the {skipped} within the top-k) + distinct routed experts "
                                       f"x {expert:,} B x {n_moe} layers: expected under uniform routing; range "
                                       f"{k} .. min({e}, tokens x {k}) experts"),
    }
    out.update(_staging(cfg, shape, steps, kv_bpt))
    out.update(_collectives(cfg, shape, steps))
    return out


def _staging(cfg: ModelConfig, shape: RunShape, steps: list[list[Row]], kv_bpt: int) -> dict[str, Predicted]:
    """`kv_bytes_staged` (model/layers/prefill_staging.py): per main-KV layer, each staged row read at the layout's
    size and written as bf16, in the steps whose size and context the engine stages (common/causal.py's rule)."""
    if not shape.prefill_staging or not stages_latent(shape.kv_layout, cfg.kv_lora_rank):
        return {}
    rows = sum(staged_rows([r.prefix + r.new for r in s], sum(r.new for r in s), shape.page_size) for s in steps)
    row_bytes = kv_bpt + staged_row_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    n_kv = cfg.num_hidden_layers
    return {"kv_bytes_staged": _exact(rows * row_bytes * n_kv, f"{rows} rows staged (steps of >= "
                                      f"{STAGING_MIN_TOKENS} tokens, <= {STAGING_ROWS_PER_TOKEN} rows a token) x "
                                      f"{row_bytes} B (read + bf16 write) x {n_kv} layers")}


def _collectives(cfg: ModelConfig, shape: RunShape, steps: list[list[Row]]) -> dict[str, Predicted]:
    dep = Deployment(tp=shape.tp, ep=shape.ep, dp_attention=shape.dp_attention)
    asm = Assumptions(act_bytes=ACT_BYTES[shape.dtype])
    calls: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    for s in steps:
        for r in step_plan(cfg, dep, asm, sum(x.new for x in s), logits_rows=len(s)):
            calls[r.kind] = calls.get(r.kind, 0) + r.calls
            nbytes[r.kind] = nbytes.get(r.kind, 0) + r.total_message  # a2a rows are already this rank's input
    out = {}
    for kind in sorted(set(calls) | {"all_reduce", "all_gather"}):
        out[f"collective_calls.{kind}"] = _exact(calls.get(kind, 0), f"TP{shape.tp}: see the collectives section"
                                                 if shape.tp > 1 else "one rank: no collective is issued")
        out[f"collective_bytes.{kind}"] = _exact(nbytes.get(kind, 0), "message bytes per rank, summed")
    return out


def predict_pool(cfg: ModelConfig, kv_layout: str, num_pages: int, page_size: int = 64,
                 sink_pages: int = 0) -> dict[str, Predicted]:
    """What KVPoolInfo must say for a pool of `num_pages` usable pages (+ `sink_pages` in its buffers)."""
    kv_bpt, idx_bpt = kv_bytes_per_token_layer(cfg, kv_layout), indexer_bytes_per_token_layer(cfg, kv_layout)
    n_kv, n_full = cfg.num_hidden_layers, len(cfg.full_indexer_layers)
    per_token = kv_bpt * n_kv + idx_bpt * n_full
    tokens = num_pages * page_size
    return {
        "kv_pool.kv_bytes_per_token_per_layer": _exact(kv_bpt, f"{kv_layout} layout"),
        "kv_pool.indexer_bytes_per_token_per_layer": _exact(idx_bpt, "FP8 key + FP32 scale (debug layouts: plain)"),
        "kv_pool.kv_layers": _exact(n_kv, "num_hidden_layers"),
        "kv_pool.indexer_layers": _exact(n_full, "full indexer layers"),
        "kv_pool.bytes_per_token": _exact(per_token, f"{kv_bpt} x {n_kv} + {idx_bpt} x {n_full}"),
        "kv_pool.num_tokens": _exact(tokens, f"{num_pages} pages x {page_size}"),
        "kv_pool.total_bytes": _exact((tokens + sink_pages * page_size) * per_token,
                                      f"(tokens + {sink_pages} sink pages x {page_size}) x bytes per token"),
    }


def pages_needed(shape: RunShape) -> int:
    """Pages the run holds at its peak: every request to prompt + max_tokens - 1 tokens, all running at once."""
    return sum(math.ceil((p + shape.max_tokens - 1) / shape.page_size) for p in shape.prompt_lens)


@dataclass(frozen=True)
class ReconcileRow:
    term: str
    predicted: float
    measured: float | None
    lo: float
    hi: float
    why: str

    @property
    def ratio(self) -> float | None:
        if self.measured is None:
            return None
        if self.predicted == 0:
            return 1.0 if self.measured == 0 else math.inf
        return self.measured / self.predicted

    @property
    def ok(self) -> bool | None:
        if self.measured is None:
            return None
        return self.lo <= self.measured <= self.hi

    @property
    def tolerance(self) -> str:
        return "exact" if self.lo == self.hi else f"[{self.lo:,.0f}, {self.hi:,.0f}]"


def reconcile(predicted: dict[str, Predicted], counters: dict[str, float],
              kv_pool: dict[str, Any] | None = None) -> list[ReconcileRow]:
    """Predicted vs measured per term. Counters the prediction does not know appear with predicted 0 if they
    are collective counts (an unexpected collective is a failure), and are ignored otherwise."""
    measured = dict(counters)
    measured.update({f"kv_pool.{k}": v for k, v in (kv_pool or {}).items()})
    rows = [ReconcileRow(name, p.value, measured.get(name, 0 if not name.startswith("kv_pool.") else None),
                         p.lo, p.hi, p.why) for name, p in predicted.items()]
    for name, v in sorted(counters.items()):
        if name.startswith(("collective_calls.", "collective_bytes.")) and name not in predicted:
            rows.append(ReconcileRow(name, 0, v, 0, 0, "not predicted: a collective the ledger does not expect"))
    return rows


@dataclass
class RunRecord:
    config: str
    shape: RunShape
    counters: dict[str, float]
    kv_pool: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def model(self) -> ModelConfig:
        return load_config(self.config)

    def prediction(self) -> dict[str, Predicted]:
        cfg = self.model()
        pred = predict_run(cfg, self.shape, self.counters.get("moe_experts_touched"))
        if self.kv_pool.get("num_pages"):
            pred.update(predict_pool(cfg, self.shape.kv_layout, int(self.kv_pool["num_pages"]),
                                     int(self.kv_pool.get("page_size", self.shape.page_size)), self.shape.sink_pages))
        return pred

    def rows(self) -> list[ReconcileRow]:
        return reconcile(self.prediction(), self.counters, self.kv_pool)

    def to_dict(self) -> dict[str, Any]:
        s = self.shape
        return {"config": self.config,
                "deployment": {"tp": s.tp, "ep": s.ep, "dp_attention": s.dp_attention},
                "workload": {"prompt_lens": list(s.prompt_lens), "max_tokens": s.max_tokens,
                             "kv_layout": s.kv_layout, "dtype": s.dtype, "page_size": s.page_size,
                             "max_num_batched_tokens": s.max_num_batched_tokens,
                             "chunked_prefill_size": s.chunked_prefill_size,
                             "max_running_requests": s.max_running_requests, "sink_pages": s.sink_pages,
                             "prefill_staging": s.prefill_staging,
                             "decode_graph_widths": list(s.decode_graph_widths),
                             "decode_graph_max_bs": s.decode_graph_max_bs, "segment_tokens": s.segment_tokens},
                "counters": dict(self.counters), "kv_pool": dict(self.kv_pool), **self.extra}


def _widths(v: Any) -> tuple:
    """A run file's decode_graph_widths as a tuple (RunShape checks its items); not a list is an error."""
    if not isinstance(v, list | tuple):
        raise ValueError(f"run file workload.decode_graph_widths: expected a list of pages, got {v!r}")
    return tuple(v)


def _no_unknown(where: str, d: dict[str, Any], known: Any) -> None:
    for k in d:
        if k not in known:
            raise ValueError(f"run file {where}{k}: unknown field")


def _counters(counters: Any) -> dict[str, float]:
    """{name: number} of common/counters.py's names (`is_counter_name`)."""
    if not isinstance(counters, dict) or any(not isinstance(v, int | float) for v in counters.values()):
        raise ValueError("run file counters: expected {name: number}")
    for k in counters:
        if not is_counter_name(k):
            raise ValueError(f"run file counters.{k}: unknown counter (common/counters.py lists them)")
    return {k: float(v) for k, v in counters.items()}


def run_from_dict(d: dict[str, Any]) -> RunRecord:
    """Validate a run file's dict; errors name the field."""
    for key in ("config", "workload", "counters"):
        if key not in d:
            raise ValueError(f"run file: missing {key!r}")
    _no_unknown("", d, RUN_FIELDS)
    if not isinstance(d["config"], str):
        raise ValueError(f"run file config: expected a model name or config.json path, got {d['config']!r}")
    dep, work = d.get("deployment") or {}, d["workload"]
    if not isinstance(dep, dict):
        raise ValueError(f"run file deployment: expected {{tp, ep, dp_attention}}, got {dep!r}")
    _no_unknown("deployment.", dep, ("tp", "ep", "dp_attention"))
    if not isinstance(work, dict) or "prompt_lens" not in work or "max_tokens" not in work:
        raise ValueError("run file workload: needs prompt_lens and max_tokens")
    counters = _counters(d["counters"])
    _no_unknown("workload.", work, RunShape.__dataclass_fields__)
    shape = RunShape(**{**{k: v for k, v in work.items()}, "prompt_lens": tuple(work["prompt_lens"]),
                        "decode_graph_widths": _widths(work.get("decode_graph_widths", ())),
                        "tp": int(dep.get("tp", 1)), "ep": int(dep.get("ep", 1)),
                        "dp_attention": bool(dep.get("dp_attention", False))})
    rest = {k: v for k, v in d.items() if k in RUN_EXTRA}
    return RunRecord(d["config"], shape, counters, dict(d.get("kv_pool") or {}), rest)


def load_run(path: str | Path) -> RunRecord:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"--reconcile: run file {p} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--reconcile: {p} is not JSON ({e})") from None
    return run_from_dict(d)
