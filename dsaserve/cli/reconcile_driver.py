"""Reconcile driver: run the real offline engine on a small config and record a run file for reconcile.py.

Owns: the one place the ledger's reconcile meets the engine (it sits above both, so the ledger imports
no engine) — `run_engine` imports the Engine (and so torch) inside the function, resets COUNTERS after
startup (the memory profile and warmup are not the workload), generates greedily with ignore_eos so every
request produces exactly max_tokens, and returns a `RunRecord` (counters snapshot + KV pool info + the
scheduler limits the prediction replays).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dsaserve.common.kv_layout import DEFAULT_KV_LAYOUT
from dsaserve.ledger.reconcile import RunRecord, RunShape

DEFAULT_PROMPTS = (5, 17, 70)  # a sub-page prompt, a mid-page one, one past a page boundary
DEFAULT_MAX_TOKENS = 6


def make_prompts(prompt_lens: tuple[int, ...], vocab: int) -> list[list[int]]:
    """Distinct first tokens, so no prompt's full page can hit another's in the prefix cache."""
    span = max(vocab - 2, 1)
    return [[2 + (13 * i + 7 * j) % span for j in range(n)] for i, n in enumerate(prompt_lens)]


def _pool_info(eng: Any) -> dict[str, Any]:
    return dataclasses.asdict(eng.kv_pool_info())


def _stages_prefills(device: str) -> bool:
    """Whether this run's kernels stage large prefills (model/layers/prefill_staging.py): the GPU ops, switch on."""
    from dsaserve.common import envs
    from dsaserve.kernels.registry import get_ops

    return bool(envs.DSASERVE_PREFILL_STAGING) and get_ops(device).impls.get("stage_latent") != "reference"


def _graph_widths(eng: Any) -> dict[str, Any]:
    """The CUDA graphs' RunShape fields from the engine's start-up manifest (none on the CPU)."""
    m = eng.core.manifest() if hasattr(eng.core, "manifest") else {}
    decode, piecewise = m.get("cuda_graph") or {}, m.get("piecewise_cuda_graph") or {}
    widths = tuple(decode.get("page_table_widths") or ()) if decode.get("buckets") else ()
    return {"decode_graph_widths": widths, "decode_graph_max_bs": int(decode.get("max_bs") or 0) if widths else 0,
            "segment_tokens": int(piecewise.get("max_tokens") or max(piecewise.get("buckets") or [0]))}


def run_engine(model: str = "glm-5.3-tiny", prompt_lens: tuple[int, ...] = DEFAULT_PROMPTS,
               max_tokens: int = DEFAULT_MAX_TOKENS, kv_layout: str = DEFAULT_KV_LAYOUT, dtype: str = "float32",
               device: str = "cpu", **engine_args: Any) -> RunRecord:
    from dsaserve.common.counters import COUNTERS
    from dsaserve.common.sampling_params import SamplingParams
    from dsaserve.engine.engine import Engine

    eng = Engine(model=model, kv_layout=kv_layout, dtype=dtype, device=device, **engine_args)
    vocab = eng.core.cfg.vocab_size if hasattr(eng.core, "cfg") else 512
    prompts = make_prompts(tuple(prompt_lens), vocab)
    was_enabled, COUNTERS.enabled = COUNTERS.enabled, True
    COUNTERS.reset()
    try:
        eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        counters = COUNTERS.snapshot()
    finally:
        COUNTERS.enabled = was_enabled
    a, pool = eng.args, _pool_info(eng)
    # engine/model_runner.py adds one sink page on CUDA (graph padding rows write there); KVPoolInfo does not say so
    sink = int(pool.get("sink_pages", 1 if device == "cuda" else 0))
    shape = RunShape(tuple(prompt_lens), max_tokens, kv_layout, dtype, page_size=int(pool["page_size"]),
                     max_num_batched_tokens=a.max_num_batched_tokens, chunked_prefill_size=a.chunked_prefill_size,
                     max_running_requests=a.max_running_requests, sink_pages=sink,
                     prefill_staging=_stages_prefills(device), **_graph_widths(eng))
    stats = eng.core.stats() if hasattr(eng.core, "stats") else {}
    return RunRecord(model, shape, counters, pool, {"engine_stats": stats, "device": device})
