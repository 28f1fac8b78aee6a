"""Prefill staging on the GPU (`kernels/triton_kv_stage.py`) against its reference: the pages' rows dequantised to
bf16 exactly as the reference rounds them, the top-k remapped to them, and sparse MLA over the staged rows against
sparse MLA over the cache itself (the staging must change no number). Set-up: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import encode_latent, get_kv_layout
from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import BF16, BIG, DEVICE, poison_free_memory, randn, rel, requires_gpu_kernels

pytestmark = requires_gpu_kernels
FP8, BF16_LAYOUT = get_kv_layout("fp8_ds_mla"), get_kv_layout("bf16")
PS = 64


def _case(gen, pool_pages: int, staged_pages: int):
    cache = encode_latent(randn(pool_pages * PS, 576, gen=gen), FP8, 512)
    pages = torch.randperm(pool_pages, generator=gen, device=DEVICE)[:staged_pages].to(torch.int32)
    page_map = torch.full((pool_pages,), -1, dtype=torch.int32, device=DEVICE)
    page_map[pages.long()] = torch.arange(staged_pages, dtype=torch.int32, device=DEVICE)
    return cache, pages, page_map


def test_stage_latent_writes_the_references_bf16_rows(gen):
    from dsaserve.kernels import triton_kv_stage

    cache, pages, _ = _case(gen, 40 if BIG else 6, 23 if BIG else 3)
    poison_free_memory()
    got = torch.empty(pages.numel() * PS + 5, 576, dtype=torch.bfloat16, device=DEVICE)  # rows past them: untouched
    got[-5:] = 7.0
    triton_kv_stage.stage_latent(cache, FP8, pages, PS, 512, got)
    want = R.stage_latent(cache, FP8, pages, PS, 512, torch.empty_like(got))
    assert torch.equal(got[:-5], want[:-5]), f"seed {gen.initial_seed()}"
    assert bool((got[-5:] == 7.0).all())
    with pytest.raises(ValueError, match="only fp8_ds_mla"):
        triton_kv_stage.stage_latent(cache, BF16_LAYOUT, pages, PS, 512, got)
    with pytest.raises(ValueError, match="kv_cache rows are 656 B, expected 592"):  # out's width: 32 rope values
        triton_kv_stage.stage_latent(cache, FP8, pages, PS, 512, got[:, :544])


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_remap_slots_maps_staged_pages_and_keeps_minus_one(gen, dtype):
    from dsaserve.kernels import triton_kv_stage

    _, pages, page_map = _case(gen, 12, 5)
    phys = (pages.long()[torch.randint(0, 5, (7, 3000), generator=gen, device=DEVICE)] * PS
            + torch.randint(0, PS, (7, 3000), generator=gen, device=DEVICE))
    unstaged = int((page_map < 0).nonzero()[0])
    phys[0, :10] = unstaged * PS + 3  # a page with no staged copy: skipped, not read from elsewhere
    phys[1, 2000:] = -1
    got = triton_kv_stage.remap_slots(phys.to(dtype), page_map, PS)
    want = R.remap_slots(phys.to(dtype), page_map, PS)
    assert got.dtype == dtype and torch.equal(got, want)
    assert bool((got[0, :10] == -1).all()) and bool((got[1, 2000:] == -1).all())
    assert torch.equal(got[2].long(), page_map[phys[2] // PS].long() * PS + phys[2] % PS)
    columns = phys.to(dtype).t().contiguous().t()  # a view whose slots of one token are not one run
    assert torch.equal(triton_kv_stage.remap_slots(columns, page_map, PS), want)


@pytest.mark.parametrize("t", [600, 1100] if BIG else [3])
def test_sparse_mla_over_staged_rows_matches_the_fp8_cache(gen, t):
    """The staged path's kernel config (bf16 rows, 2 stages from 512 tokens) against the fp8 kernel on the same
    selection: the same dequantised values, so the same output but for fp32 summation order."""
    from dsaserve.kernels import triton_kv_stage, triton_sparse_mla

    h, k = (64, 2048) if BIG else (64, 96)
    cache, pages, page_map = _case(gen, 80 if BIG else 6, 64 if BIG else 4)
    logical = torch.randint(0, pages.numel() * PS, (t, k), generator=gen, device=DEVICE)
    slots = (pages.long()[logical // PS] * PS + logical % PS).to(torch.int32)
    slots[0, k // 2:] = -1
    qn, qr = randn(t, h, 512, gen=gen, dtype=torch.bfloat16), randn(t, h, 64, gen=gen, dtype=torch.bfloat16)
    rows = torch.empty(pages.numel() * PS, 576, dtype=torch.bfloat16, device=DEVICE)
    triton_kv_stage.stage_latent(cache, FP8, pages, PS, 512, rows)
    staged = triton_kv_stage.remap_slots(slots, page_map, PS)
    got = triton_sparse_mla.sparse_mla_attention(qn, qr, rows.view(torch.uint8), BF16_LAYOUT, staged, 0.04, 512)
    want = triton_sparse_mla.sparse_mla_attention(qn, qr, cache, FP8, slots, 0.04, 512)
    assert rel(got, want) < BF16 / 10, f"seed {gen.initial_seed()}"
    if not BIG:  # the interpreter's sizes: against the reference as well
        assert rel(got, R.sparse_mla_attention(qn, qr, cache, FP8, slots, 0.04, 512)) < BF16
