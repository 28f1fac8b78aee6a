"""Warmup of what the graphs do not capture (startup chain: "warmup", after "capture CUDA graphs").

Owns: running `engine/warmup_plan.py`'s attention-core shapes through the piecewise runner (each a real
step whose KV goes to the sink page) and, for speculative decoding, through the MTP layer, and its sampler
variants through a throwaway Sampler, so each kernel variant is compiled (Triton) or loaded (CUDA's lazy
module loading) before Up; and `KernelLoads`, the in-process count of Triton kernels the JIT had to compile or
load after Up (`kernel_loads_after_up`: unlike `kernel_compiles_after_up`, the cache-directory count, it also
sees a variant a warm disk cache loads).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from dsaserve.common import envs
from dsaserve.common.counters import COUNTERS
from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.kernel_precompile import chain_post_compile_hook
from dsaserve.engine.warmup_plan import SAMPLER_VARIANTS, WarmupPlan
from dsaserve.model.forward_batch import ForwardBatch
from dsaserve.model.sampler import Sampler


def core_batch(rows: int, pages: int, page_size: int, max_len: int, sink_page: int) -> ForwardBatch:
    """One request's chunk of `rows` tokens ending its context (min(pages x page_size, max_len) tokens),
    with a page table `pages` wide; every page is the sink page, so it reads and writes nobody's KV."""
    seq = min(pages * page_size, max_len)
    rows = min(rows, seq)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    pos = list(range(seq - rows, seq))
    return ForwardBatch(i64([1] * rows), i64(pos), i64([0] * rows), i64([seq]), i64([rows]),
                        torch.full((1, pages), sink_page, dtype=torch.int64),
                        i64([sink_page * page_size + p % page_size for p in pos]), i64([rows - 1]), page_size,
                        [seq], [rows])


def warm_core_shapes(piecewise, plan: WarmupPlan, max_len: int, preloaded: bool = False) -> int:
    """Every (rows, width) of the plan through the piecewise path; the number of steps run. `preloaded`: every
    Triton kernel a start of this configuration loads is already in the JITs (engine/warm_start.py), so only
    one shape per class runs (its torch kernels and allocations), not the row sweep."""
    pool = piecewise.pool
    run = piecewise.warm_cores if envs.DSASERVE_WARMUP_CORES_ONLY else piecewise.forward
    shapes = plan.class_shapes if preloaded else plan.core_shapes
    enabled, COUNTERS.enabled = COUNTERS.enabled, False  # warmup is not traffic
    try:
        for rows, pages in shapes:
            run(core_batch(rows, pages, pool.page_size, max_len, pool.sink_page))
        if pool.kv_buffer.is_cuda:
            torch.cuda.synchronize()
    finally:
        COUNTERS.enabled = enabled
    return len(shapes)


def decode_rows_batch(rows: int, pages: int, page_size: int, max_len: int, sink_page: int) -> ForwardBatch:
    """`rows` requests of one token each at the end of a context `pages` wide (as `core_batch`, on the sink page):
    a decode step's shape, and speculative decoding's chained draft steps' (engine/mtp.py)."""
    seq = min(pages * page_size, max_len)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
    slot = sink_page * page_size + (seq - 1) % page_size
    return ForwardBatch(i64([1] * rows), i64([seq - 1] * rows), i64(list(range(rows))), i64([seq] * rows),
                        i64([1] * rows), torch.full((rows, pages), sink_page, dtype=torch.int64), i64([slot] * rows),
                        i64(list(range(rows))), page_size, [seq] * rows, [1] * rows)


def warm_mtp(model, pool, plan: WarmupPlan, max_len: int, preloaded: bool = False, decode_rows: bool = True) -> int:
    """The MTP layer's eager forward (speculative decoding, engine/mtp.py) before Up, so its kernel variants load
    then: at the plan's attention-core shapes (one request's chunk: the extend after a long prompt) and, with
    `decode_rows` (no MTP graphs, whose captures run them), at each decode bucket's one token a request (the chained
    draft steps), each selection class's width. Every batch's KV goes to the sink page. The number of forwards
    run."""
    shapes = plan.class_shapes if preloaded else plan.core_shapes
    widths = sorted({pages for _, pages in plan.class_shapes or shapes})
    batches = [core_batch(rows, pages, pool.page_size, max_len, pool.sink_page) for rows, pages in shapes]
    batches += [decode_rows_batch(bs, pages, pool.page_size, max_len, pool.sink_page)
                for bs in (plan.decode if decode_rows else ()) for pages in widths]
    device = pool.kv_buffer.device
    enabled, COUNTERS.enabled = COUNTERS.enabled, False  # warmup is not traffic
    try:
        for batch in batches:
            batch = batch.to(device)
            model.forward_mtp(batch, pool, torch.zeros(batch.num_tokens, model.cfg.hidden_size, dtype=model.dtype,
                                                       device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        COUNTERS.enabled = enabled
    return len(batches)


@dataclass
class _Row:
    """What the sampler reads of a request (model/sampler.py SampleSource)."""

    sampling: SamplingParams
    suppressed_token_ids: tuple[int, ...] = ()
    grammar: Any = None
    generator: Any = None
    prompt_token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    output_token_ids: list[int] = field(default_factory=lambda: [4, 4, 5])


class _AllowAll:
    """A grammar state whose bitmask allows every token (the mask is applied all the same)."""

    active = True

    def __init__(self, vocab: int):
        self.vocab_size = vocab

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -1

    def observe(self, token: int) -> None:
        pass


def warm_sampler(device: torch.device, vocab: int, eos: tuple[int, ...], dtype: torch.dtype = torch.float32
                 ) -> list[str]:
    """Each sampler variant once on the device, beside a greedy row, on logits of the lm_head's dtype; the
    variants run."""
    sampler = Sampler(seed=0)
    logits = torch.randn(2, vocab, device=device, generator=torch.Generator(device).manual_seed(0)).to(dtype)
    sampler.sample(logits[:1], [_Row(SamplingParams(temperature=0.0))])  # a plain greedy batch: the argmax alone
    for kw in SAMPLER_VARIANTS.values():
        row = _Row(SamplingParams(**kw), suppressed_token_ids=tuple(eos) if kw.get("min_tokens") else (),
                   grammar=_AllowAll(vocab) if kw.get("structured_outputs") else None)
        sampler.sample(logits, [row, _Row(SamplingParams(temperature=0.0))])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return list(SAMPLER_VARIANTS)


def _describe(hook_kwargs: dict[str, Any]) -> str:
    """A JIT hook's kernel as name, warps, constexprs, argument types and their attributes (16-divisible
    integers and pointers: what tells two specialisations apart; Triton 3.6's `repr` leaves the types out)."""
    fn, spec = hook_kwargs.get("fn"), hook_kwargs.get("compile") or {}
    name = getattr(fn, "name", None) or str(hook_kwargs.get("repr", "?")).split("[")[0]
    attrs = (spec.get("configs") or [None])[0]
    return (f"{name}[num_warps={spec.get('num_warps')}] constexprs {spec.get('constants')} "
            f"signature {spec.get('signature')} attrs {attrs}")[:800]


class KernelLoads:
    """COUNTERS source `kernel_loads_after_up`: Triton kernels compiled or loaded from disk (a JIT in-memory
    miss) after `mark_up()`. Chains to a hook someone else installed; absent (0) without Triton's knobs."""

    def __init__(self) -> None:
        self.count, self.at_up = 0, None
        self.installed = chain_post_compile_hook(self._loaded)

    def _loaded(self, kwargs: dict[str, Any]) -> None:
        self.count += 1
        if self.at_up is not None:  # the kernel and specialisation a slow first request paid for, by name
            logging.getLogger(__name__).warning("Triton kernel loaded after Up, a specialisation the warmup did "
                                                "not launch: %s", _describe(kwargs))

    def mark_up(self) -> None:
        self.at_up = self.count

    def read(self, reset: bool = False) -> dict[str, float]:
        n = self.count - self.at_up if self.at_up is not None else 0
        if reset and self.at_up is not None:
            self.at_up = self.count
        return {"kernel_loads_after_up": n}
