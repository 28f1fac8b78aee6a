"""What warmup runs before Up, derived from the scheduler's limits (startup chain: "warmup"). Pure Python.

Owns: the CUDA-graph bucket lists (decode batch sizes; piecewise token counts), the attention-core shapes
and the sampler variants warmup runs, so that every step the scheduler can form finds its kernels compiled
and its first-use costs paid before the server says Up (issue 16: `kernel_compiles_after_up` stays 0).
`engine/warmup.py` runs the plan; tests check the plan against the scheduler's limits without a GPU.

A step of the scheduler has 1..max_num_batched_tokens tokens over 1..max_running_requests rows, each row
with a page table up to max_model_len / page_size pages wide. Every such step is served by exactly one of:
- a decode CUDA graph (every row decodes one token; bucket >= rows, `decode_buckets`);
- the piecewise CUDA graphs of a token bucket (`piecewise_buckets`), with the attention core between the
  segments running eagerly on the step's own rows and page-table width, whose compiled variants are the
  classes of `kernels/variants.py`, each warmed at one representative shape (`core_shapes`);
- an eager forward, counted by reason, only when graphs are off or the configured buckets stop short.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.kernels.variants import (
    ROW_SWEEP,
    SELECT_MAX_ROWS,
    attention_row_class,
    selection_class,
    width_representatives,
)

# Sampler code paths (model/sampler.py branches on these SamplingParams fields); each runs once on the device
# before Up, beside a greedy row (a step mixes rows of every kind). Grammar: a token bitmask (no compiler).
SAMPLER_VARIANTS: dict[str, dict] = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "top_k": {"temperature": 0.8, "top_k": 20},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
    "seeded": {"temperature": 0.8, "seed": 1},
    "repetition_penalty": {"temperature": 0.0, "repetition_penalty": 1.2},
    "frequency_presence": {"temperature": 0.0, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "logprobs": {"temperature": 0.0, "logprobs": 0},
    "top_logprobs": {"temperature": 0.8, "logprobs": 5},
    "min_tokens": {"temperature": 0.0, "min_tokens": 4},
    "grammar": {"temperature": 0.0, "structured_outputs": {"kind": "regex", "value": "[a-z]+"}},
}


def decode_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16 (SGLang's shape of bucket list)."""
    out = [b for b in (1, 2, 4) if b < max_bs]
    b = 8
    while b < max_bs:
        out.append(b)
        b += 8 if b < 64 else 16
    return sorted(set(out + [max_bs]))


# the default largest bucket: measured on an H200 (piecewise_buckets); one 64-row step past the attention core's
# last row class (ROW_SWEEP + 1 = 513 rows) so that class is warmed through the piecewise path
PIECEWISE_MAX_TOKENS = 576


def piecewise_buckets(max_tokens: int, cap: int = PIECEWISE_MAX_TOKENS) -> list[int]:
    """Token counts of the piecewise graphs: 8, 16, 32, then every 64 up to min(max_tokens, cap) (576), and
    that bound itself. A larger step runs eagerly, counted as `eager_large_steps` (not a fallback).

    Why this shape: a replay saves the host's launches of every per-token op (~25 per layer, tens of µs each
    on the H200's host), a constant per step; padding costs the GPU time of the padded rows. Up to ~512
    tokens a layer's GEMMs read their weights once whatever the row count (padding is nearly free, but
    M <= 32 has its own skinny GEMM path, hence 8/16/32). Why the cap: on the H200 (glm-5.3-slice, 32 decode
    rows + a chunk) piecewise replay took a mixed step of 288 tokens from 14.1 to 12.0 ms, but one of 1056
    tokens (33.9 ms) and of 4128 (99.8 ms) not at all: past a few hundred tokens the GPU time hides the
    launches, while each bucket costs capture time at every start-up and graph-pool memory. Padded rows
    are identical (token 0 at position 0, zero attention output): they add at most one row's experts."""
    if max_tokens < 1:
        raise ValueError(f"piecewise_buckets: max_tokens must be positive, got {max_tokens}")
    top = min(max_tokens, cap)
    out = [8, 16, 32, *range(64, cap + 1, 64)]
    return sorted({b for b in out if b < top} | {top})


def parse_buckets(text: str, flag: str) -> list[int]:
    """'64,128,256' -> [64, 128, 256]: positive, strictly increasing (errors name the flag)."""
    try:
        vals = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of token counts") from None
    if not vals or any(v <= 0 for v in vals) or vals != sorted(set(vals)):
        raise ValueError(f"{flag}: {text!r} must be positive token counts in increasing order")
    return vals


def bucket_for(n: int, buckets: list[int] | tuple[int, ...]) -> int | None:
    """The smallest bucket >= n (None: past the largest)."""
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True)
class WarmupPlan:
    decode: tuple[int, ...]  # decode graph batch sizes
    piecewise: tuple[int, ...]  # piecewise graph token counts
    core_shapes: tuple[tuple[int, int], ...]  # (rows, page-table width in pages) run through the piecewise path
    sampler: tuple[str, ...]  # SAMPLER_VARIANTS keys
    max_pages: int  # widest page table a request can have
    page_size: int
    topk: int
    # one shape per selection class and width, and a power-of-two sample of the row sweep: what a warm start whose
    # kernels were all preloaded still runs (engine/warm_start.py), for the torch kernels and allocations
    class_shapes: tuple[tuple[int, int], ...] = ()

    @classmethod
    def build(cls, decode_max_bs: int, piecewise: list[int], max_pages: int, page_size: int,
              topk: int) -> WarmupPlan:
        """decode_max_bs 0 / piecewise []: that kind of graph is off. Core shapes: every row count up to
        ROW_SWEEP + 1 at the narrowest width whose selection runs a kernel, then rows 1, 2, 3 and
        SELECT_MAX_ROWS + 1 and + 16 (the prefill selection's two integer classes) at one width of every
        selection class (`kernels/variants.py`)."""
        shapes: list[tuple[int, int]] = []
        per_class: list[tuple[int, int]] = []
        sample: list[tuple[int, int]] = []
        if piecewise:
            top = piecewise[-1]
            widths = width_representatives(max_pages, page_size, topk)
            base = next((w for w in widths if selection_class(1, w, page_size, topk)[0] != "all_visible"), widths[0])
            shapes += [(n, base) for n in range(1, min(ROW_SWEEP + 1, top) + 1)]
            per_class = [(n, w) for w in widths for n in (1, 2, 3, SELECT_MAX_ROWS + 1, SELECT_MAX_ROWS + 16)
                         if n <= top]
            # and a power-of-two sample of the sweep: the core's torch ops (GEMM kernels chosen by row count,
            # allocations) meet each size range once
            sample = [(1 << k, base) for k in range(ROW_SWEEP.bit_length()) if 1 << k <= min(ROW_SWEEP, top)]
        return cls(tuple(decode_buckets(decode_max_bs)) if decode_max_bs else (), tuple(piecewise),
                   tuple(dict.fromkeys(shapes + per_class)), tuple(SAMPLER_VARIANTS), max_pages, page_size, topk,
                   tuple(dict.fromkeys(sample + per_class)))

    def core_class(self, rows: int, pages: int) -> tuple:
        """The attention core's compiled variants for a step of `rows` tokens and a `pages`-wide page table."""
        return attention_row_class(rows), selection_class(rows, pages, self.page_size, self.topk)

    def warmed_core_classes(self) -> set[tuple]:
        """Classes the core shapes reach; the two parts vary independently, so each is checked on its own."""
        return {c for n, w in self.core_shapes for c in self.core_class(n, w)}
