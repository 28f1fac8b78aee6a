"""Piecewise CUDA graphs: steps with a prefill part (startup chain: "capture CUDA graphs"; mixed and prefill
steps after). vLLM V1's default and SGLang's piecewise graphs, on this model's segments.

Owns: per token bucket T (`engine/warmup_plan.py`), one CUDA graph per segment of the forward
(`DsaForCausalLM.segment`: embedding + layer 0 up to its attention core; then each layer's o_proj +
residual + norm + MLP/MoE + the next layer's pre-attention ops; the last ends at the final norm), the static
inputs they read (input_ids, positions, out_cache_loc of T tokens: padding rows are token 0 at position 0
writing the sink page) and the pinned staging that brings a host batch to the device in one copy. Between
the segments each layer's attention core (indexer scores + top-k, sparse MLA) runs eagerly on the step's own
rows and page table (width padded to `kernels/variants.CORE_WIDTH_ALIGN` pages): the part whose work and
shapes depend on the requests' lengths. The lm_head runs eagerly on the logits rows. Counters: one
`piecewise_replays` per step, the segments' collectives measured once per bucket (as the decode graphs do).

Memory: all buckets share one graph pool (the decode graphs keep theirs). A segment's outputs are held by
weak references (vLLM's weak_ref_tensors): during capture each is freed when the forward is done with it,
as in an eager forward, so the pool holds about one eager forward of the largest bucket; a replay
reproduces the capture's order, so no later segment overwrites what an earlier core still reads.
Off CUDA nothing is captured and the same segments run eagerly (the CPU tests check segmented == plain).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch

from dsaserve.common.counters import COUNTERS, Counters
from dsaserve.engine.graph_capture import capture_bucket, lean_capture
from dsaserve.engine.overlap import resolve_placeholders_
from dsaserve.engine.warmup_plan import bucket_for
from dsaserve.kernels.registry import get_ops
from dsaserve.kernels.variants import core_width
from dsaserve.model.forward_batch import ForwardBatch
from dsaserve.model.glm_moe_dsa import SegmentCarry
from dsaserve.model.layers.context import StepContext
from dsaserve.model.layers.mla import AttentionInputs
from dsaserve.model.step_counts import count_step


def weak_ref(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor over t's memory that does not keep it allocated (CUDA only; other tensors as they are)."""
    if t is None or t.device.type != "cuda":
        return t
    nbytes = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))) * t.element_size()
    storage = torch._C._construct_storage_from_data_pointer(t.data_ptr(), t.device, nbytes)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape, t.stride())


def _weak_carry(c: SegmentCarry) -> SegmentCarry:
    a = c.attn
    return SegmentCarry(weak_ref(c.residual), AttentionInputs(
        **{f.name: weak_ref(getattr(a, f.name)) if f.name != "selecting" else a.selecting for f in fields(a)}))


@dataclass
class _Segment:
    graph: torch.cuda.CUDAGraph
    carry: SegmentCarry  # its outputs: weak references, except the last segment's hidden states


ROWS = 4  # per-token rows: input_ids, positions, out_cache_loc (what the segments read), req_index (the core)
ALIGN = 16  # elements: every field of the staging buffer starts 128-byte aligned, whatever the step's sizes,
# so the core's Triton kernels always see pointers of the same alignment (Triton specialises on it)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PiecewiseRunner:
    def __init__(self, model, pool, buckets: list[int], max_rows: int, max_pages: int,
                 future_token_ids: torch.Tensor | None = None):
        if pool.sink_page < 0:
            raise ValueError("PiecewiseRunner: the KV pool needs a sink page (padding rows write their KV there)")
        self.model, self.pool, self.page_size = model, pool, pool.page_size
        self.buckets, self.max_tokens = sorted(buckets), max(buckets)
        self.max_rows, self.max_pages = max_rows, core_width(max_pages)
        dev = pool.kv_buffer.device
        self.capture_graphs = dev.type == "cuda"
        # staging layout (int64): ROWS per-token rows of `stride` (the segments' at fixed addresses), the
        # per-request fields (seq_lens, extend_lens, logits_indices: up to one per token), then the page table
        self.stride = _aligned(self.max_tokens)
        self.table_at = ROWS * self.stride + _aligned(2 * max_rows + self.max_tokens)
        n = self.table_at + max_rows * self.max_pages
        self.host = torch.zeros(n, dtype=torch.int64, pin_memory=self.capture_graphs)
        self.host_np = self.host.numpy()
        self.dev = torch.zeros(n, dtype=torch.int64, device=dev)
        self.staged = torch.cuda.Event() if self.capture_graphs else None  # the last H2D copy has read `host`
        self.sink_slot = pool.sink_page * self.page_size
        self.contexts: dict[int, StepContext] = {}  # per bucket: what eager segments read (off CUDA, warm runs)
        self.graphs: dict[int, list[_Segment]] = {}
        self.static_counts: dict[int, dict[str, float]] = {}
        self.pool_handle = None
        self.stream = torch.cuda.Stream(dev) if self.capture_graphs else None
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.capture_retries = 0  # buckets captured again after an eager run (capture(warm_each=False))
        self.future_token_ids = future_token_ids  # overlap scheduling: placeholder ids resolve after the copy

    # ---- routing ----------------------------------------------------------------------------
    def fallback_reason(self, batch: ForwardBatch) -> str | None:
        """None if this batch can run on the piecewise graphs, else why it runs eager (counted by reason)."""
        if batch.num_tokens > self.max_tokens:
            return "tokens_over_piecewise_max"
        if batch.batch_size > self.max_rows:
            return "rows_over_piecewise_max"
        if batch.page_table.shape[1] > self.max_pages:
            return "context_over_capture"
        return None

    # ---- capture ----------------------------------------------------------------------------
    def capture(self, pool_handle=None, warm_each: bool = True) -> list[int]:
        """Per bucket, largest first: one eager run (compiles the segments' kernels; measures their
        collectives), then on CUDA one graph per segment into the buckets' shared pool (`pool_handle`: one
        to join, or None for a new one). Off CUDA the capture is a no-op: the segments stay eager.
        warm_each=False (a warm start whose preload loaded every recorded kernel): only the largest bucket
        runs eagerly first; a bucket whose capture fails so, or a run with collectives, is warmed as before."""
        t0 = time.perf_counter()
        self.pool_handle = pool_handle
        before = torch.cuda.memory_reserved() if self.capture_graphs else 0
        self.capture_retries = 0
        for i, bucket in enumerate(sorted(self.buckets, reverse=True)):
            if not self.capture_graphs:
                self.static_counts[bucket] = self._warm(bucket)
                continue
            self.static_counts[bucket], self.graphs[bucket], warmed, retried = capture_bucket(
                lambda b=bucket: self._warm(b), lambda b=bucket: self._capture(b), warm_each or i == 0)
            warm_each = warm_each or bool(self.static_counts[bucket])
            self.capture_retries += retried
            if not warmed:  # its buffers as an eager run leaves them (finite): the core warmup reads them
                with torch.inference_mode():  # as every step's (the buffers are inference tensors)
                    self._run(bucket, 0, None, eager=False)
        if self.capture_graphs:
            torch.cuda.synchronize()
            self.capture_bytes = torch.cuda.memory_reserved() - before
        self.capture_seconds = time.perf_counter() - t0
        return sorted(self.static_counts)

    def _segment_context(self, bucket: int) -> StepContext:
        """The context segments of `bucket` read: views of the static rows (the core's fields are unused)."""
        t, d = self.stride, self.dev
        none = d[:0]
        batch = ForwardBatch(d[:bucket], d[t:t + bucket], none, none, none, none.view(0, 1), d[2 * t:2 * t + bucket],
                             none, self.page_size)
        return self.model.segment_context(batch, self.pool)

    @torch.inference_mode()
    def _warm(self, bucket: int) -> dict[str, float]:
        """One eager run of the bucket's segments on padding rows only (no core); their collectives."""
        pad = torch.tensor([[0], [0], [self.sink_slot]], device=self.dev.device)  # token 0, position 0, the sink
        self.dev[:3 * self.stride].view(3, self.stride)[:, :bucket] = pad
        before = COUNTERS.host_values()
        self._run(bucket, 0, None, eager=True)
        static = {k: v for k, v in Counters.diff(COUNTERS.host_values(), before).items() if k.startswith("collective_")}
        COUNTERS.restore(before)  # startup work is not traffic
        return static

    @torch.inference_mode()
    def _capture(self, bucket: int) -> list[_Segment]:
        torch.cuda.synchronize()
        ctx = self._segment_context(bucket)
        out: list[_Segment] = []
        carry = None
        enabled, COUNTERS.enabled = COUNTERS.enabled, False  # capture-time Python must not count
        try:
            for i in range(self.model.num_segments):
                graph = torch.cuda.CUDAGraph()
                with lean_capture(graph, self.pool_handle, self.stream):
                    carry = self.model.segment(i, ctx, carry)  # the previous carry is freed here, as eagerly
                if self.pool_handle is None:
                    self.pool_handle = graph.pool()
                out.append(_Segment(graph, carry if carry.attn is None else _weak_carry(carry)))
        finally:
            COUNTERS.enabled = enabled
        return out

    # ---- steps ------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits [len(batch.logits_indices), vocab] of a host batch of up to max_tokens tokens."""
        return self.forward_with_hidden(batch)[0]

    @torch.inference_mode()
    def forward_with_hidden(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the logits, the final hidden states [bucket, H]: the batch's in its first num_tokens rows)."""
        n = batch.num_tokens
        bucket = bucket_for(n, self.buckets)
        core = self._stage(batch if not batch.input_ids.is_cuda else batch.to("cpu"), bucket)
        ctx = StepContext(core, self.pool, None, None, get_ops(self.dev.device))
        hidden = self._run(bucket, n, ctx, eager=bucket not in self.graphs)
        logits = self.model.compute_logits(hidden[core.logits_indices])
        if bucket in self.graphs:
            COUNTERS.add("piecewise_replays")
            for k, v in self.static_counts[bucket].items():
                COUNTERS.add(k, v)
        count_step(self.model.forward_shape(), self.pool, batch, pages=core.page_table.shape[1], segments=True)
        return logits, hidden

    @torch.inference_mode()
    def warm_cores(self, batch: ForwardBatch) -> None:
        """Warmup: each layer's attention core on the batch's rows, on the buffers the bucket's segments last
        wrote (finite: the capture's padding rows, or a later step's), without the segments around them. The
        core is all a step runs eagerly, so its kernel variants are all the step's shape decides that capture
        did not already compile; the segments' GEMMs, most of the step's device time, are skipped. Without
        graphs (CPU) the plain forward."""
        bucket = bucket_for(batch.num_tokens, self.buckets)
        if bucket not in self.graphs:
            self.forward(batch)
            return
        core = self._stage(batch if not batch.input_ids.is_cuda else batch.to("cpu"), bucket)
        ctx = StepContext(core, self.pool, None, None, get_ops(self.dev.device))
        for i, segment in enumerate(self.graphs[bucket]):
            if segment.carry.attn is None:
                return
            self.model.attention_core(i, ctx, segment.carry.attn.rows(batch.num_tokens))

    def _run(self, bucket: int, n: int, core: StepContext | None, eager: bool) -> torch.Tensor:
        """The bucket's segments (replayed, or eager) with each layer's core on the first n rows between them;
        padding rows get a zero attention output, so they stay identical (and route to the same experts)."""
        segments = None if eager else self.graphs[bucket]
        ctx = None
        if eager:
            ctx = self.contexts.get(bucket) or self.contexts.setdefault(bucket, self._segment_context(bucket))
        carry = None
        for i in range(self.model.num_segments):
            if eager:
                carry = self.model.segment(i, ctx, carry)
            else:
                segments[i].graph.replay()
                carry = segments[i].carry
            if carry.attn is None:
                return carry.hidden
            if n:
                self.model.attention_core(i, core, carry.attn.rows(n))
            if n < bucket:
                carry.attn.latent[n:].zero_()
        raise AssertionError("the last segment returns the hidden states")

    def _stage(self, batch: ForwardBatch, bucket: int) -> ForwardBatch:
        """The host batch into the pinned staging buffer (per-token rows padded to the bucket, the requests'
        fields, the page table padded to the core's width), one copy to the device, and the core's batch
        as views of it."""
        n, b, w = batch.num_tokens, batch.batch_size, core_width(batch.page_table.shape[1])
        t, h, nl = self.stride, self.host_np, batch.logits_indices.numel()
        if self.staged is not None:
            self.staged.synchronize()
        for row, (src, pad) in enumerate(((batch.input_ids, 0), (batch.positions, 0),
                                          (batch.out_cache_loc, self.sink_slot), (batch.req_index, 0))):
            h[row * t:row * t + n] = src.numpy()
            h[row * t + n:row * t + bucket] = pad
        o = ROWS * t
        for src in (batch.seq_lens, batch.extend_lens, batch.logits_indices):
            h[o:o + src.numel()] = src.numpy()
            o += src.numel()
        table = h[self.table_at:self.table_at + b * w].reshape(b, w)
        table[:, : batch.page_table.shape[1]] = batch.page_table.numpy()
        table[:, batch.page_table.shape[1]:] = self.pool.sink_page
        end = self.table_at + b * w
        self.dev[:end].copy_(self.host[:end], non_blocking=True)
        if self.staged is not None:
            self.staged.record()
        if self.future_token_ids is not None:  # before segment 0's embedding reads them (same stream)
            resolve_placeholders_(self.dev[:n], self.future_token_ids)
        d, o = self.dev, ROWS * t
        seq, ext, logit_rows = d[o:o + b], d[o + b:o + 2 * b], d[o + 2 * b:o + 2 * b + nl]
        seq_cpu, ext_cpu = batch.host_lens()
        return ForwardBatch(d[:n], d[t:t + n], d[3 * t:3 * t + n], seq, ext, d[self.table_at:end].view(b, w),
                            d[2 * t:2 * t + n], logit_rows, self.page_size, seq_cpu, ext_cpu,
                            page_table_cpu=batch.page_table)
