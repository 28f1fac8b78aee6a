"""Prefill staging: a prefill step's sparse MLA reads its context's latent rows dequantised once a layer (issue 17).

Owns: `for_step(ctx, kv_lora_rank)`, the step's `PrefillStaging` or None, decided once per step (StepContext) and
used by every layer's attention core: the pages the step's requests attend to (each distinct page once: a page
two requests share, a prefix-cache hit, is staged once), a map from a physical page to its place among them, and
one bf16 buffer of their rows that each layer rewrites (`stage_latent`) before its sparse MLA; the top-k slots are
remapped to rows of that buffer once per selection (full layers select, shared layers reuse theirs).

When (bench/RESULTS.md, tenth session, one H200): fp8_ds_mla at kv_lora 512 on the GPU kernels, a step of at least
MIN_TOKENS tokens, and a context of at most ROWS_PER_TOKEN rows per token; so never a decode step (a page a
token), nor a forward captured into a CUDA graph (a piecewise graph's attention cores run eagerly, each step with
its own StepContext). The decision counts each request's pages from the lengths (common/causal.py's rule, the
ledger's too), so a step whose requests share pages decides as if they did not, and stages fewer rows.
Sparse MLA over staged bf16 rows (2-stage cp.async gathers) ran 1.17-1.18x the fp8 kernel at T = 4096-16384 with
the staging counted (its ~30 us a layer), 1.12x at T = 512 over an 8K context, but 0.91x at T = 128 (too few
tokens share each staged row).
Memory: ROWS_PER_TOKEN x 1152 B a token at most (9 KB, against 64 KB of the same step's q_abs alone); the memory
profile adds what its dummy prefill did not stage (`reserve_bytes`).
Numbers: the same as the fp8 kernel's (the FP32 product of e4m3 and scale, rounded to bf16 once).
Host sync: none where the batch carries the host's page table (`ForwardBatch.page_table_cpu`: the engine's eager
and piecewise steps): the page list is built on the host and copied once, pinned and non-blocking, and the page
map is scattered on the device; a batch made on the device alone syncs once (`torch.unique`).
DSASERVE_PREFILL_STAGING=0 is the A/B switch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dsaserve.common import envs
from dsaserve.common.causal import (
    STAGING_MIN_TOKENS,
    STAGING_ROWS_PER_TOKEN,
    staged_row_bytes,
    staged_rows,
    stages_latent,
)
from dsaserve.common.counters import COUNTERS
from dsaserve.common.kv_layout import BF16, KVLayout

MIN_TOKENS = STAGING_MIN_TOKENS  # 512: 1.12x at T=512 (8K context), 0.91x at T=128
ROWS_PER_TOKEN = STAGING_ROWS_PER_TOKEN  # 8: 1.12x at 4096 tokens over 32768 rows; bounds the buffer a step allocates


@dataclass
class PrefillStaging:
    pages: torch.Tensor  # [P] int32: the distinct physical pages the step's requests attend to, sorted
    page_map: torch.Tensor  # [pool pages] int32: page -> its index in `pages` (-1: not staged)
    rows: torch.Tensor  # [P * page_size, kv_lora + rope] bf16: one layer's rows, rewritten by each layer
    page_size: int
    _selection: torch.Tensor | None = field(default=None, repr=False)  # the top-k the remap below is of
    _remapped: torch.Tensor | None = field(default=None, repr=False)

    def stage(self, ops, kv_cache: torch.Tensor, layout: KVLayout, slots: torch.Tensor,
              kv_lora_rank: int) -> tuple[torch.Tensor, KVLayout, torch.Tensor]:
        """(this layer's rows as a bf16-layout cache, its layout, the top-k as rows of it) for sparse MLA."""
        ops.stage_latent(kv_cache, layout, self.pages, self.page_size, kv_lora_rank, self.rows)
        # what the staging moves (the ledger's `kv_bytes_staged`): each row read from the cache, written as bf16
        COUNTERS.add("kv_bytes_staged", self.rows.shape[0] * (kv_cache.shape[1] + self.rows[0].nbytes))
        if slots is not self._selection:  # a full layer selected anew; shared layers reuse its remap
            self._selection, self._remapped = slots, ops.remap_slots(slots, self.page_map, self.page_size)
        return self.rows.view(torch.uint8), BF16, self._remapped


def for_step(ctx, kv_lora_rank: int) -> PrefillStaging | None:
    """The step's staging (built by its first attention core), or None when this step reads the cache itself."""
    if ctx.staging is None:
        ctx.staging = _plan(ctx, kv_lora_rank) or False
    return ctx.staging or None


def _may_stage(ops, layout: KVLayout, kv_lora_rank: int, tokens: int) -> bool:
    return (envs.DSASERVE_PREFILL_STAGING and ops.impls.get("stage_latent", "reference") != "reference"
            and stages_latent(layout.name, kv_lora_rank) and tokens >= MIN_TOKENS)


def reserve_bytes(ops, layout: KVLayout, kv_lora_rank: int, rope_dim: int, tokens: int) -> int:
    """What a step of `tokens` may stage beyond a context of its own length (the memory profile's dummy prefill
    stages its own pages, at least `tokens` rows; a chunk deep into a long prompt stages up to ROWS_PER_TOKEN times
    as many: the rule's rows bound the distinct pages a step stages)."""
    if not _may_stage(ops, layout, kv_lora_rank, tokens):
        return 0
    return (ROWS_PER_TOKEN - 1) * tokens * staged_row_bytes(kv_lora_rank, rope_dim)


def _plan(ctx, kv_lora_rank: int) -> PrefillStaging | None:
    batch, pool, ops = ctx.batch, ctx.pool, ctx.ops
    if not _may_stage(ops, pool.layout, kv_lora_rank, batch.num_tokens):
        return None
    if batch.page_table.is_cuda and torch.cuda.is_current_stream_capturing():
        # a decode graph's capture (its buckets may reach MIN_TOKENS rows): the page list would be the capture's,
        # and its host copies cannot be captured. A page a token is past ROWS_PER_TOKEN anyway (64 > 8)
        return None
    ps = batch.page_size
    seq_lens, _ = batch.host_lens()
    if not staged_rows(seq_lens, batch.num_tokens, ps, MIN_TOKENS, ROWS_PER_TOKEN):  # the ledger's rule, shared
        return None
    host = batch.page_table_cpu if batch.page_table_cpu is not None else (
        batch.page_table if batch.page_table.device.type == "cpu" else None)
    pages = _distinct_pages(batch.page_table, seq_lens, ps, host)
    total, dev = pages.numel(), pages.device
    page_map = torch.full((pool.kv_cache(0).shape[0] // ps,), -1, dtype=torch.int32, device=dev)
    page_map[pages.long()] = torch.arange(total, dtype=torch.int32, device=dev)
    rows = torch.empty(total * ps, kv_lora_rank + pool.cfg.qk_rope_head_dim, dtype=torch.bfloat16, device=dev)
    return PrefillStaging(pages, page_map, rows, ps)


def _distinct_pages(page_table: torch.Tensor, seq_lens: list[int], page_size: int,
                    host_table: torch.Tensor | None = None) -> torch.Tensor:
    """Every request's pages up to its seq_len, each physical page once (sorted, int32, on the page table's device).
    Requests that share a prefix share its pages: staged once per request, such a page was read and written, and
    counted, as often, and held that many rows of the buffer (the remap used one copy; a warmup batch of sink pages
    staged its one page once a column). `host_table`: the host's copy of the page table (the engine's batches keep
    it): the list is built there and goes to the device in one non-blocking copy from pinned memory, so the step's
    host never waits for the device here (the device's table alone needs `torch.unique`'s sync on its size)."""
    n_pages = np.array([-(-s // page_size) for s in seq_lens], dtype=np.int64)
    total = int(n_pages.sum())
    dev = page_table.device
    req = np.repeat(np.arange(len(seq_lens)), n_pages)
    local = np.arange(total) - np.repeat(np.cumsum(n_pages) - n_pages, n_pages)
    if host_table is not None:
        pages = torch.from_numpy(np.unique(host_table.numpy()[req, local]).astype(np.int32))
        if dev.type == "cpu":
            return pages
        # pinned: the copy is asynchronous, and the caching host allocator keeps the block until it is done
        return (pages.pin_memory() if dev.type == "cuda" else pages).to(dev, non_blocking=True)
    return torch.unique(page_table[torch.from_numpy(req).to(dev), torch.from_numpy(local).to(dev)]).to(torch.int32)
