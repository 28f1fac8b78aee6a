"""One token's sparse MLA tile when its top-k is all valid slots (`full_rows`, `triton_sparse_mla.FULL_ROW_CONFIG`:
a batch-1 decode step past index_topk keys) against the reference. Set-up and error bounds:
tests/kernels/gpu_common.py; runs on a GPU or the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import encode_latent
from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import BF16, DEVICE, gpu_modules, poison_free_memory, randn, rel, requires_gpu_kernels

pytestmark = requires_gpu_kernels


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("short", [False, True])
def test_one_token_of_full_rows_takes_the_static_64_head_tile(gen, layout, short):
    """`full_rows` (a batch-1 step past the top-k) gives one token FULL_ROW_CONFIG's tile, GLM's shapes; a row
    that is not full after all (the hint wrong: no narrow graph class) still gets the reference's numbers."""
    mla = gpu_modules()[4]
    h, dc, dr, k, n_slots = 64, 512, 64, 2048, 4096
    cache = encode_latent(randn(n_slots, dc + dr, gen=gen), layout, dc)
    slots = torch.randperm(n_slots, generator=gen, device=DEVICE)[:k][None].contiguous()
    if short:
        slots[0, 700:] = -1
    qn, qr = randn(1, h, dc, gen=gen, dtype=torch.bfloat16), randn(1, h, dr, gen=gen, dtype=torch.bfloat16)
    poison_free_memory()
    got = mla.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc, full_rows=True)
    ref = R.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc)
    assert torch.isfinite(got).all() and rel(got, ref) < BF16, f"seed {gen.initial_seed()}"
    tiled = mla.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc, config=mla.FULL_ROW_CONFIG)
    assert torch.equal(got, tiled)
