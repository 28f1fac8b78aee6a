"""Memory profile and warmup (startup chain: "memory profile" -> "allocate the KV pool" -> "warmup").

Owns: the dummy batches (largest prefill chunk, largest decode batch), measuring peak activation memory
with a throwaway pool, the KV budget formula SGLang uses —
    pool bytes = total x mem_fraction_static - weights - peak activations - graph reserve
(with piecewise CUDA graphs, minus one more forward's activations: their pool keeps them) — and running
every configured prefill chunk size once before Up so its kernels are compiled and its temporaries
allocated before the first request (note 000: "warmup 覆盖哪些形状").
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from dsaserve.common import envs
from dsaserve.common.counters import COUNTERS
from dsaserve.common.kv_layout import KVLayout
from dsaserve.engine import prompt_logprobs
from dsaserve.engine.dp_step import as_gather_step
from dsaserve.engine.kv_pool import KVPool
from dsaserve.kernels.registry import get_ops
from dsaserve.model.forward_batch import ForwardBatch, contiguous_batch
from dsaserve.model.layers import prefill_staging
from dsaserve.model.layers.context import takes_every_key

logger = logging.getLogger(__name__)

GiB = 1 << 30


@dataclass
class MemoryProfile:
    total_bytes: int
    weights_bytes: int
    peak_activation_bytes: int
    graph_reserve_bytes: int
    mem_fraction_static: float
    kv_budget_bytes: int

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update({k.replace("_bytes", "_gib"): round(v / GiB, 3) for k, v in d.items() if k.endswith("_bytes")})
        return d


def dummy_prefill(tokens: int, page_size: int, vocab: int, device, max_len: int | None = None) -> ForwardBatch:
    """`tokens` prompt tokens, as one request or, past max_len, as requests of max_len: positions stay below
    max_position_embeddings, the rows of the GPU path's RoPE table (glm-5.3-mini has 2048; eval's 2304-token
    budget indexed past it: a device-side assert on every GPU setting)."""
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    # whole pages per request: the batch takes the pages one request of `tokens` would, no more
    step = tokens if max_len is None or tokens <= max_len else max(page_size, max_len // page_size * page_size)
    reqs = [ids[i:i + step] for i in range(0, tokens, step)]
    return contiguous_batch(reqs, [0] * len(reqs), [i * page_size * -(-step // page_size) for i in range(len(reqs))],
                            page_size).to(device)


def dummy_decode(bs: int, context: int, page_size: int, device, vocab_size: int = 0,
                 seed: int | None = None) -> ForwardBatch:
    """bs requests, each with `context` tokens already cached in its own page range, decoding one token.

    vocab_size > 0: each request decodes its own token (a draw seeded by `seed`, default bs: DP-attention ranks
    pass their own), as the distinct requests of a serving batch do, so the routers spread the batch over the
    experts; 0: every request decodes token 1 (identical rows route alike: a batch of 128 touched ~12 of 32
    experts a layer on the slice, bench/RESULTS.md)."""
    pages = -(-(context + 1) // page_size)
    bases = [r * pages * page_size for r in range(bs)]
    draw = torch.Generator().manual_seed(bs if seed is None else seed)
    tokens = torch.randint(1, vocab_size, (bs,), generator=draw).tolist() if vocab_size > 0 else [1] * bs
    batch = contiguous_batch([[t] for t in tokens], [context] * bs, bases, page_size).to(device)
    # a request a builder row, each taken anew by this batch (a wide graph's mirror stages all its pages once)
    batch.table_rows, batch.table_gens = np.arange(bs), np.full(bs, next(_DUMMY_GENS), dtype=np.int64)
    return batch


# the dummy batches' row generations: far above any the scheduler counts (engine/page_table_mirror.py), one a batch
_DUMMY_GENS = itertools.count(1 << 48)


def indexer_score_budget() -> int:
    """Bytes of fp32 indexer scores one prefill slice may hold (the GPU indexer's SCORE_BUDGET)."""
    try:
        from dsaserve.kernels.triton_indexer import SCORE_BUDGET
    except ImportError:  # no Triton: the reference indexer scores one request at a time
        return 0
    return SCORE_BUDGET


def unscored_query_bytes(cfg, batch: ForwardBatch, dtype: torch.dtype) -> int:
    """The indexer's queries (q [T, heads, dim] in the activation dtype, head weights [T, heads] counted at 4 B: fp32,
    or bf16 where the scale folded) that a dummy prefill within the top-k never makes (`StepContext.all_keys`),
    where a chunk of its size after a cached prefix makes them; 0 when the dummy scores."""
    if not cfg.full_indexer_layers or not takes_every_key(cfg, batch):
        return 0
    return batch.num_tokens * cfg.index_n_heads * (cfg.index_head_dim * dtype.itemsize + 4)


def profile_memory(model, cfg, layout: KVLayout, dtype, device, kv_layer_ids: list[int], max_prefill_tokens: int,
                   max_decode_bs: int, mem_fraction_static: float, graph_reserve_bytes: int,
                   activation_copies: int = 1, dp_world: int = 1) -> MemoryProfile:
    """Run the largest prefill chunk and the largest decode batch on a throwaway pool; size the real pool.
    activation_copies 2: the piecewise graphs' pool keeps one forward's activations at the largest token
    bucket for good, beside what eager work (the attention cores, fallbacks) still allocates. `dp_world` > 1
    (DP-attention): both as gather steps of that many ranks (engine/dp_step.py), the largest MoE
    activations a step may have."""
    torch.cuda.synchronize()
    _, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    page = 64
    pages = max(-(-max_prefill_tokens // page), max_decode_bs * 2) + 1
    scratch = KVPool(cfg, pages, layout, kv_layer_ids, page, dtype, device)
    scratch_bytes = scratch.info().total_bytes
    torch.cuda.reset_peak_memory_stats(device)
    enabled, COUNTERS.enabled = COUNTERS.enabled, False  # the profile is not traffic
    try:
        prefill = dummy_prefill(max_prefill_tokens, page, cfg.vocab_size, device, cfg.max_position_embeddings)
        model(as_gather_step(prefill, dp_world), scratch)
        decode = dummy_decode(min(max_decode_bs, pages // 2), 1, page, device, cfg.vocab_size)
        model(as_gather_step(decode, dp_world), scratch)
        torch.cuda.synchronize()
    finally:
        COUNTERS.enabled = enabled
    # the dummy prefill has no earlier context; with one, the indexer's score slices grow to their budget and a
    # prefill stages up to 8x more context rows (model/layers/prefill_staging.py); and a chunk of its size after a
    # cached prefix, or as piecewise segments, makes the indexer queries a dummy within the top-k does not
    eager_only = indexer_score_budget() + prefill_staging.reserve_bytes(
        get_ops(device), layout, cfg.kv_lora_rank, cfg.qk_rope_head_dim, max_prefill_tokens)
    queries = unscored_query_bytes(cfg, prefill, dtype)
    peak = torch.cuda.max_memory_allocated(device) - weights - scratch_bytes + eager_only + queries
    del scratch
    torch.cuda.empty_cache()
    # the graphs' pool holds neither the scores nor the staging: the attention core allocates them eagerly (the
    # queries are the segments' own: in it)
    graph_pool = max(peak - eager_only, 0) * (activation_copies - 1)
    # a step that scores its prompt projects blocks of rows through the LM head after the forward, eagerly (not in
    # the graphs' pool): as much again of a small model's activations (at GLM-5.3: 555 MB against GBs of a 2K chunk's)
    peak = max(peak, prompt_logprobs.block_bytes(cfg.vocab_size))
    budget = int(total * mem_fraction_static - weights - peak - graph_pool - graph_reserve_bytes)
    if budget <= 0:
        raise RuntimeError(f"mem_fraction_static: {mem_fraction_static} leaves no room for the KV pool "
                           f"(weights {weights / GiB:.1f} GiB, activations {peak / GiB:.1f} GiB of {total / GiB:.1f})")
    return MemoryProfile(total, weights, max(peak, 0), graph_reserve_bytes, mem_fraction_static, budget)


def warmup_prefill(model, pool: KVPool, chunk_sizes: list[int], vocab: int, dp_world: int = 1) -> list[int]:
    """One eager forward per configured chunk size, writing into the first pages (nobody owns them yet);
    under DP-attention (`dp_world` > 1) as the gather step it would be."""
    warmed = []
    enabled, COUNTERS.enabled = COUNTERS.enabled, False
    try:
        for n in sorted(set(chunk_sizes)):
            if -(-n // pool.page_size) > pool.num_pages:
                continue
            model(as_gather_step(dummy_prefill(n, pool.page_size, vocab, pool.kv_buffer.device,
                                               model.cfg.max_position_embeddings), dp_world), pool)
            warmed.append(n)
        if pool.kv_buffer.is_cuda:
            torch.cuda.synchronize()
    finally:
        COUNTERS.enabled = enabled
    return warmed


def _kernel_name(entry: Path) -> str:
    """A Triton cache entry holds `<kernel>.json` (metadata) beside its binaries, and `__grp__<kernel>.json`."""
    names = [p.stem for p in entry.glob("*.json") if not p.name.startswith("__grp__")] if entry.is_dir() else []
    if names:
        return names[0]
    files = sorted(p.name for p in entry.iterdir()) if entry.is_dir() else []
    return f"? (holding {', '.join(files[:4]) or 'nothing'})"  # e.g. a launcher stub built at a first launch


class CompileCache:
    """Triton's on-disk kernel cache under --cache-dir, so a restart does not recompile. Counted as entries
    present before startup and entries created during it (misses: kernels compiled by this start)."""

    def __init__(self, cache_dir: str | Path | None):
        root = Path(cache_dir).expanduser() if cache_dir else envs.cache_root()
        self.dir = root / "triton"
        self.dir.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("TRITON_CACHE_DIR", str(self.dir))
        self.triton_dir = Path(os.environ["TRITON_CACHE_DIR"])  # the user's, when set: it may not exist yet
        self.before = self._entries()
        self.logged: set[str] = set()
        self.t0 = time.perf_counter()

    def _entries(self) -> set[str]:
        return {p.name for p in self.triton_dir.iterdir()} if self.triton_dir.is_dir() else set()

    def mark_up(self) -> None:
        """Startup is over: from now on a new cache entry is a kernel compiled on a request's time."""
        self.at_up = self._entries()

    def compiles_after_up(self, reset: bool = False) -> dict[str, float]:
        """COUNTERS source: `kernel_compiles_after_up`, the cold-path compiles warmup did not cover; each new one
        is logged once by kernel name (the shape warmup missed is what a slow first request hunts for)."""
        now = self._entries()
        new = now - getattr(self, "at_up", now)
        for entry in sorted(new - self.logged):
            logger.warning("Triton kernel %s compiled after Up: a shape the warmup did not cover (%s)",
                           _kernel_name(self.triton_dir / entry), entry)
        self.logged |= new
        n = len(new)
        if reset:
            self.at_up = now
        return {"kernel_compiles_after_up": n}

    def report(self) -> dict:
        """status: "hit" (every kernel came from the cache), "miss" (an empty cache: all compiled now),
        "partial" (some compiled now), "empty" (no kernel was needed)."""
        after = self._entries()
        compiled, before = len(after - self.before), len(self.before)
        status = ("partial" if compiled else "hit") if before else ("miss" if compiled else "empty")
        return {"status": status, "dir": str(self.triton_dir), "entries_before": before,
                "compiled_this_start": compiled}
