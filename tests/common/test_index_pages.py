"""The indexer cache's page-major placement (`common/index_pages.py`): a page's keys, then their scales."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common import index_pages as ip
from dsaserve.common.kv_layout import encode_index_k


@pytest.mark.parametrize("layout,width", [("fp8_ds_mla", 36), ("bf16", 64), ("fp32", 128)])
def test_rows_round_trip_through_pages(layout, width):
    rows = encode_index_k(torch.randn(24, 32), layout)
    assert rows.shape[1] == ip.row_bytes(layout, 32) == width
    cache = ip.pack_pages(rows, layout, 32, page_size=8)
    assert cache.shape == (3, 8 * width) and ip.page_size_of(cache, layout, 32) == 8
    slots = torch.tensor([17, 3, 8, 23])
    assert torch.equal(ip.read_rows(cache, slots, layout, 32), rows[slots])


def test_an_fp8_page_holds_its_keys_then_their_scales():
    rows = encode_index_k(torch.randn(8, 32), "fp8_ds_mla")
    cache = ip.pack_pages(rows, "fp8_ds_mla", 32, page_size=4)
    page1 = cache[1]
    for o in range(4):
        assert torch.equal(page1[32 * o:32 * o + 32], rows[4 + o, :32])  # key o at o x D
        assert torch.equal(page1[128 + 4 * o:128 + 4 * o + 4], rows[4 + o, 32:])  # its scale after the 4 keys
    keys, scales = ip.key_views(cache, "fp8_ds_mla", 32)
    assert keys.shape == (2, 4, 32) and scales.shape == (2, 4)


def test_write_rows_touches_only_its_slots():
    cache = torch.zeros(2, 4 * 36, dtype=torch.uint8)
    rows = encode_index_k(torch.randn(2, 32), "fp8_ds_mla")
    ip.write_rows(cache, torch.tensor([5, 2]), rows, "fp8_ds_mla", 32)
    assert torch.equal(ip.read_rows(cache, torch.tensor([5, 2]), "fp8_ds_mla", 32), rows)
    assert ip.read_rows(cache, torch.tensor([0, 1, 3, 4, 6, 7]), "fp8_ds_mla", 32).eq(0).all()


def test_a_cache_that_is_not_whole_keys_is_refused():
    with pytest.raises(ValueError, match="index_cache.*page_size x 36"):
        ip.page_size_of(torch.zeros(2, 100, dtype=torch.uint8), "fp8_ds_mla", 32)


def test_a_negative_slot_is_refused_not_wrapped():
    cache = torch.zeros(2, 4 * 36, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slot -1"):
        ip.read_rows(cache, torch.tensor([3, -1]), "fp8_ds_mla", 32)
