"""The warp-specialised Gluon sparse MLA over bf16 rows (`kernels/gluon_sparse_mla_ws.py`) against the reference and
against the single-partition Gluon kernel on the same rows: prefill-sized batches (one program a token), decode
batches (top-k splits merged), an odd number of 64-key blocks (WG1's last block empty), masked heads, -1 tails,
holes and a token with no valid slot; every A/B combination of its switches (gluon_sparse_mla_ws.CANDIDATES) on
the same cases (a quicker set: the same rows, fewer shapes). Needs sm_90 and Gluon (skipped elsewhere). Set-up:
tests/kernels/gpu_common.py. Only the variants:  pytest -q tests/kernels/test_gpu_sparse_mla_ws.py -k variant
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import get_kv_layout
from dsaserve.kernels import gluon_sparse_mla
from dsaserve.kernels import gluon_sparse_mla_ws as ws
from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import BF16, DEVICE, poison_free_memory
from tests.kernels.test_gpu_sparse_mla_gluon import _case, assert_close_on_kept_tokens

pytestmark = pytest.mark.skipif(DEVICE != "cuda" or not gluon_sparse_mla.available(torch.device(DEVICE)),
                                reason="the Gluon kernels need an sm_90 GPU and Gluon")
BF16_LAYOUT = get_kv_layout("bf16")
# to the single-partition kernel, which rounds P in another order (up to 1.01e-3 seen on the H200, random seeds)
SINGLE_BOUND = BF16 / 5


CASES = [(600, 64, 2048, 1), (300, 64, 1984, 1), (16, 64, 2048, None), (40, 40, 1000, None), (128, 64, 2048, 4),
         (1000, 64, 64, 1), (520, 128, 2048, 1)]  # DeepSeek-V3.2's 128 heads: two head blocks
# the variants' cases: unsplit with an odd block count and -1 tails, one 64-key block, two head blocks, split
VARIANT_CASES = [(300, 64, 1984, 1), (1000, 64, 64, 1), (520, 128, 2048, 1), (128, 64, 2048, 4)]


@pytest.mark.parametrize("t,h,k,splits", CASES)
def test_warp_specialised_kernel_matches_the_reference_and_the_single_partition_kernel(gen, t, h, k, splits):
    _check(gen, t, h, k, splits, {})


@pytest.mark.parametrize("name", [n for n in ws.CANDIDATES if n != "ws"])
@pytest.mark.parametrize("t,h,k,splits", VARIANT_CASES)
def test_each_variant_matches_the_reference_and_the_single_partition_kernel(gen, name, t, h, k, splits):
    """...and today's schedule bit for bit: no switch changes the arithmetic (the same wgmma in the same order
    on the same bf16 operands), so a difference is a race (a half read before it landed or after it was reused)."""
    got, (rows, slots, qn, qr) = _check(gen, t, h, k, splits, ws.CANDIDATES[name])
    today = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, torch.empty_like(got),
                                                        {"ws": True, "splits": splits})
    assert torch.equal(got, today), f"{name}: differs from today's schedule, seed {gen.initial_seed()}"


def _check(gen, t, h, k, splits, switches):
    """The kernel with these switches against the reference and the single-partition kernel: (out, the case)."""
    rows, slots, qn, qr = _case(gen, t, h, k, 6000)
    poison_free_memory()
    got = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, torch.empty_like(qn[..., :512]),
                                                      {"ws": True, "splits": splits, "ws_variant": switches})
    single = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, torch.empty_like(got),
                                                         {"ws": False, "splits": splits})
    want = R.sparse_mla_attention(qn, qr, rows.view(torch.uint8), BF16_LAYOUT, slots, 0.04, 512)
    assert_close_on_kept_tokens(gen, got, want, single, SINGLE_BOUND)
    return got, (rows, slots, qn, qr)


def test_warp_specialised_kernel_is_the_default_for_unsplit_bf16_rows(gen):
    """The registry's op takes it for bf16 rows when the top-k is not split (prefill-sized batches)."""
    rows, slots, qn, qr = _case(gen, 600, 64, 2048, 6000)
    got = gluon_sparse_mla.sparse_mla_attention(qn, qr, rows.view(torch.uint8), BF16_LAYOUT, slots, 0.04, 512)
    ws = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, torch.empty_like(got), {"ws": True})
    assert torch.equal(got, ws)


FP8_CASES = [(128, 64, 2048, 1), (300, 64, 1984, 1), (16, 64, 2048, None), (40, 40, 1000, None), (520, 128, 2048, 1),
             (128, 64, 2048, 4), (1000, 64, 64, 1)]


@pytest.mark.parametrize("switches", [None, {"PIN": True}, {"PIN": True, "L2_AHEAD": 2}])
@pytest.mark.parametrize("t,h,k,splits", FP8_CASES)
def test_warp_specialised_fp8_kernel_equals_the_bf16_one_over_the_dequantised_rows(gen, t, h, k, splits, switches):
    """`gluon_sparse_mla_ws_fp8` over the fp8_ds_mla cache: its producer dequantises each block as the staging does
    (the FP32 product rounded once to bf16) and its consumers are the bf16 kernel's, so it gives the bf16 kernel's
    output over the dequantised rows bit for bit (a difference is a race or a misplaced byte); and the reference's
    and the single-partition fp8 kernel's within their bounds."""
    from dsaserve.common.kv_layout import decode_latent, encode_latent

    fp8 = get_kv_layout("fp8_ds_mla")
    rows, slots, qn, qr = _case(gen, t, h, k, 6000)
    cache = encode_latent(rows.float(), fp8, 512)
    poison_free_memory()
    got = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, cache, slots, 0.04, torch.empty_like(qn[..., :512]),
                                                      {"ws": True, "splits": splits, "ws_variant": switches})
    dequantised = decode_latent(cache, fp8, 512).to(torch.bfloat16)
    same = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, dequantised, slots, 0.04, torch.empty_like(got),
                                                       {"ws": True, "splits": splits})
    assert torch.equal(got, same), f"seed {gen.initial_seed()}"
    single = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, cache, slots, 0.04, torch.empty_like(got),
                                                         {"ws": False, "splits": splits})
    want = R.sparse_mla_attention(qn, qr, cache, fp8, slots, 0.04, 512)
    assert_close_on_kept_tokens(gen, got, want, single, SINGLE_BOUND)
