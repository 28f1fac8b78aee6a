"""Where the indexer cache keeps a slot's key (request path stage 6, full indexer layers; DESIGN.md "KV cache"):
the page-major placement every reader and writer of the indexer cache shares, and the torch gathers and scatters
by slot that the reference kernels, the tests and the benchmarks use.

Owns: `row_bytes`, `key_bytes`, `page_size_of`, `key_views`, `read_rows`, `write_rows`, `pack_pages`.
One layer's indexer cache is uint8 [pages, page_size x row bytes]. In the FP8 layouts a page holds its keys first
(page_size x D e4m3 bytes: slot offset o at byte o x D), then their FP32 scales (at page_size x D + 4 o):
DeepGEMM's paged layout (`fp8_paged_mqa_logits`). It is the same 132 B a token as rows of key + scale, but every
key is 16-byte aligned and a page's keys are one contiguous block, so a score kernel streams whole pages with
16-byte loads (a 132-byte row is only 4-byte aligned: the H200 read such rows at ~0.9 TB/s, bench/RESULTS.md).
Plain (bf16 / fp32 debugging) layouts have no scale: their page is its rows. A "row" below is the codec's
(`KVLayout.encode_index_k`): key bytes, then the scale's 4 bytes in the FP8 layouts.
Imports torch when first called, as `kv_layout`'s codec does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsaserve.common.kv_layout import KVLayout, get_kv_layout

if TYPE_CHECKING:
    import torch


def row_bytes(layout: KVLayout | str, d: int) -> int:
    """Bytes of one key of head dim d: D e4m3 + a 4-byte scale, or D plain values."""
    layout = get_kv_layout(layout)
    return d * layout.plain_bytes if layout.plain_bytes else d + 4


def key_bytes(layout: KVLayout | str, d: int) -> int:
    """Bytes of a key's values alone (a page's stride from one key to the next)."""
    layout = get_kv_layout(layout)
    return d * layout.plain_bytes if layout.plain_bytes else d


def page_size_of(cache: torch.Tensor, layout: KVLayout | str, d: int, who: str = "index_cache",
                 expect: int | None = None) -> int:
    """Slots a page of `cache` holds; an error naming `who` unless it is uint8 [pages, page_size x row bytes]
    (and, with `expect`, unless page_size is the caller's: a reader told another page size would misread)."""
    rb = row_bytes(layout, d)
    if cache.dim() != 2 or cache.shape[1] % rb or cache.shape[1] == 0:
        raise ValueError(f"{who}: indexer cache pages must be [pages, page_size x {rb}] bytes for head dim {d}, "
                         f"got {tuple(cache.shape)}")
    if expect is not None and cache.shape[1] // rb != expect:
        raise ValueError(f"{who}: the cache's pages hold {cache.shape[1] // rb} keys, page_size is {expect}")
    return cache.shape[1] // rb


def key_views(cache: torch.Tensor, layout: KVLayout | str, d: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(keys uint8 [pages, page_size, key bytes], scales float32 [pages, page_size] or None): views of the cache."""
    import torch

    ps, kb = page_size_of(cache, layout, d), key_bytes(layout, d)
    keys = cache[:, :ps * kb].view(cache.shape[0], ps, kb)
    if get_kv_layout(layout).plain_bytes:
        return keys, None
    return keys, cache[:, ps * kb:].view(torch.float32)


def _place(keys: torch.Tensor, slots: torch.Tensor, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, offset) of each slot; a negative slot is an error (it would wrap to the last page)."""
    if slots.numel() and int(slots.min()) < 0:
        raise ValueError(f"{who}: slot {int(slots.min())} is negative")
    return slots // keys.shape[1], slots % keys.shape[1]


def read_rows(cache: torch.Tensor, slots: torch.Tensor, layout: KVLayout | str, d: int) -> torch.Tensor:
    """The codec rows [n, row bytes] of `slots` (a copy)."""
    import torch

    keys, scales = key_views(cache, layout, d)
    page, off = _place(keys, slots, "read_rows")
    if scales is None:
        return keys[page, off]
    return torch.cat([keys[page, off], scales[page, off].view(-1, 1).view(torch.uint8)], dim=1)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, layout: KVLayout | str, d: int) -> None:
    """Codec rows [n, row bytes] into `slots` of the cache."""
    import torch

    keys, scales = key_views(cache, layout, d)
    page, off = _place(keys, slots, "write_rows")
    keys[page, off] = rows[:, :keys.shape[2]]
    if scales is not None:
        scales[page, off] = rows[:, keys.shape[2]:].contiguous().view(torch.float32).view(-1)


def pack_pages(rows: torch.Tensor, layout: KVLayout | str, d: int, page_size: int) -> torch.Tensor:
    """A cache of ceil(n / page_size) pages holding codec rows [n, row bytes] at slots 0..n-1 (tests, benchmarks)."""
    import torch

    n = rows.shape[0]
    pages = -(-n // page_size)
    cache = torch.zeros(pages, page_size * row_bytes(layout, d), dtype=torch.uint8, device=rows.device)
    write_rows(cache, torch.arange(n, device=rows.device), rows, layout, d)
    return cache
