"""KVPool: the paged MLA latent cache and the indexer-key cache, allocated once (startup chain: "allocate
the KV pool once, at its final size"; request path stage 6: KV write / sparse read).

Owns: the pool's storage. One uint8 tensor holds every layer's main KV, one more the indexer K of the full
layers; neither is ever grown or moved (captured CUDA graphs hold their addresses). Page bookkeeping
(which page belongs to whom) lives in `engine/page_allocator.py`; this file only stores bytes at slots.
The byte layouts, their sizes and their codec are `common/kv_layout.py`'s KVLayout objects.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.common.kv_layout import DEFAULT_KV_LAYOUT, KVLayout, get_kv_layout
from dsaserve.config import ModelConfig

PAGE_SIZE = 64


@dataclass(frozen=True)
class KVPoolInfo:
    """What the pool reports (startup manifest, ledger reconcile)."""

    layout: str
    page_size: int
    num_pages: int
    num_tokens: int
    kv_layers: int
    indexer_layers: int
    kv_bytes_per_token_per_layer: int
    indexer_bytes_per_token_per_layer: int
    bytes_per_token: int
    total_bytes: int


def pool_pages_for_budget(cfg: ModelConfig, layout: KVLayout, budget_bytes: int, kv_layer_ids: list[int],
                          page_size: int = PAGE_SIZE) -> int:
    """How many pages a byte budget buys (main KV on every KV layer + indexer K on full layers)."""
    per_token = layout.bytes_per_token(cfg, len(kv_layer_ids), sum(cfg.is_full_indexer(i) for i in kv_layer_ids))
    return max(int(budget_bytes // (per_token * page_size)), 0)


class KVPool:
    """Paged storage for the MLA latent (`kv_lora_rank` nope + `qk_rope_head_dim` rope) and indexer K."""

    def __init__(self, cfg: ModelConfig, num_pages: int, layout: KVLayout | str = DEFAULT_KV_LAYOUT,
                 kv_layer_ids: list[int] | None = None, page_size: int = PAGE_SIZE,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", sink_pages: int = 0):
        layout = get_kv_layout(layout)
        if num_pages <= 0:
            raise ValueError(f"num_pages: the KV pool needs at least one page, got {num_pages}")
        self.cfg, self.layout, self.page_size, self.dtype = cfg, layout, page_size, dtype
        self.num_pages = num_pages  # pages the scheduler may hand out
        # sink pages sit after them: CUDA-graph padding rows write their KV there, no request ever reads it
        self.sink_page = num_pages if sink_pages else -1
        self.num_slots = (num_pages + sink_pages) * page_size
        self.kv_layer_ids = list(kv_layer_ids if kv_layer_ids is not None else range(cfg.num_hidden_layers))
        self.layer_row = {lid: i for i, lid in enumerate(self.kv_layer_ids)}
        self.index_row = {lid: i for i, lid in enumerate(x for x in self.kv_layer_ids if cfg.is_full_indexer(x))}
        self.kv_bpt = layout.kv_bytes_per_token(cfg)
        self.idx_bpt = layout.indexer_bytes_per_token(cfg)
        # the one allocation of each cache: [layers, slots, bytes]
        self.kv_buffer = torch.zeros(len(self.kv_layer_ids), self.num_slots, self.kv_bpt, dtype=torch.uint8,
                                     device=device)
        self.index_buffer = torch.zeros(max(len(self.index_row), 1), self.num_slots, self.idx_bpt,
                                        dtype=torch.uint8, device=device)

    def info(self) -> KVPoolInfo:
        per_token = self.kv_bpt * len(self.kv_layer_ids) + self.idx_bpt * len(self.index_row)
        return KVPoolInfo(self.layout.name, self.page_size, self.num_pages, self.num_pages * self.page_size,
                          len(self.kv_layer_ids),
                          len(self.index_row), self.kv_bpt, self.idx_bpt, per_token,
                          self.kv_buffer.numel() + (self.index_buffer.numel() if self.index_row else 0))

    def kv_cache(self, layer: int) -> torch.Tensor:
        """The uint8 [slots, kv_bytes] rows of one layer (what the kernels take)."""
        return self.kv_buffer[self.layer_row[layer]]

    def index_cache(self, layer: int) -> torch.Tensor:
        """The uint8 [pages, page_size x indexer bytes] pages of one full layer's indexer keys, page-major
        (`common/index_pages.py`: a page's keys, then their scales)."""
        return self.index_buffer[self.index_row[layer]].view(-1, self.page_size * self.idx_bpt)
