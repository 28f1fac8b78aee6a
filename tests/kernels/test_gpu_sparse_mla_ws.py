"""The warp-specialised Gluon sparse MLA over bf16 rows (`kernels/gluon_sparse_mla_ws.py`) against the reference and
against the single-partition Gluon kernel on the same rows: prefill-sized batches (one program a token), decode
batches (top-k splits merged), an odd number of 64-key blocks (WG1's last block empty), masked heads, -1 tails,
holes and a token with no valid slot. Needs sm_90 and Gluon (skipped elsewhere). Set-up: tests/kernels/gpu_common.py.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import get_kv_layout
from dsaserve.kernels import gluon_sparse_mla
from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import BF16, DEVICE, poison_free_memory, rel
from tests.kernels.test_gpu_sparse_mla_gluon import _case

pytestmark = pytest.mark.skipif(DEVICE != "cuda" or not gluon_sparse_mla.available(torch.device(DEVICE)),
                                reason="the Gluon kernels need an sm_90 GPU and Gluon")
BF16_LAYOUT = get_kv_layout("bf16")


@pytest.mark.parametrize("t,h,k,splits", [(600, 64, 2048, 1), (300, 64, 1984, 1), (16, 64, 2048, None),
                                          (40, 40, 1000, None), (128, 64, 2048, 4), (1000, 64, 64, 1),
                                          (520, 128, 2048, 1)])  # DeepSeek-V3.2's 128 heads: two head blocks
def test_warp_specialised_kernel_matches_the_reference_and_the_single_partition_kernel(gen, t, h, k, splits):
    rows, slots, qn, qr = _case(gen, t, h, k, 6000)
    poison_free_memory()
    got = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, torch.empty_like(qn[..., :512]),
                                                      {"ws": True, "splits": splits})
    single = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, torch.empty_like(got),
                                                         {"ws": False, "splits": splits})
    want = R.sparse_mla_attention(qn, qr, rows.view(torch.uint8), BF16_LAYOUT, slots, 0.04, 512)
    keep = torch.ones(t, dtype=torch.bool, device=DEVICE)
    if t > 2:
        keep[1] = False
        assert bool((got[1] == 0).all()), "a token without slots gets zeros"
    assert bool(torch.isfinite(got).all())
    assert rel(got[keep], want[keep]) < BF16, f"seed {gen.initial_seed()}"
    assert rel(got[keep], single[keep]) < BF16 / 10, f"seed {gen.initial_seed()}"


def test_warp_specialised_kernel_is_the_default_for_unsplit_bf16_rows(gen):
    """The registry's op takes it for bf16 rows when the top-k is not split (prefill-sized batches)."""
    rows, slots, qn, qr = _case(gen, 600, 64, 2048, 6000)
    got = gluon_sparse_mla.sparse_mla_attention(qn, qr, rows.view(torch.uint8), BF16_LAYOUT, slots, 0.04, 512)
    ws = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, torch.empty_like(got), {"ws": True})
    assert torch.equal(got, ws)
