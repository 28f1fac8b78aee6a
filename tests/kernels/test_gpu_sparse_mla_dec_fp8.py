"""The decode-schedule Gluon sparse MLA over the fp8_ds_mla cache (`kernels/gluon_sparse_mla_dec_fp8.py`) against the
reference, the single-partition fp8 kernel and the warp-specialised bf16 kernel over the dequantised rows: decode
batches (split top-k merged), prefill-sized ones, an odd number of 64-key blocks, one block, masked heads, two head
blocks, -1 tails, holes and a token with no valid slot (`_case`). Its switches only move loads and descriptors, so
each gives the default's output bit for bit (a difference is a race: a block read before it was written or after
it was reused). Needs sm_90 and Gluon (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import decode_latent, encode_latent, get_kv_layout
from dsaserve.kernels import gluon_sparse_mla
from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import DEVICE, poison_free_memory
from tests.kernels.test_gpu_sparse_mla_gluon import _case, assert_close_on_kept_tokens
from tests.kernels.test_gpu_sparse_mla_ws import FP8_CASES, SINGLE_BOUND

pytestmark = pytest.mark.skipif(DEVICE != "cuda" or not gluon_sparse_mla.available(torch.device(DEVICE)),
                                reason="the Gluon kernels need an sm_90 GPU and Gluon")
FP8 = get_kv_layout("fp8_ds_mla")
SWITCHES = [{"PIN": False}, {"PIN": True}, {"PIN": False, "EARLY_ROWS": True}]


def _run(qn, qr, rows, slots, splits, cfg):
    return gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, torch.empty_like(qn[..., :512]),
                                                       {"splits": splits, **cfg})


@pytest.mark.parametrize("t,h,k,splits", FP8_CASES)
def test_decode_schedule_matches_the_reference_and_the_other_kernels(gen, t, h, k, splits):
    rows, slots, qn, qr = _case(gen, t, h, k, 6000)
    cache = encode_latent(rows.float(), FP8, 512)
    poison_free_memory()
    got = _run(qn, qr, cache, slots, splits, {"ws": "dec"})
    want = R.sparse_mla_attention(qn, qr, cache, FP8, slots, 0.04, 512)
    single = _run(qn, qr, cache, slots, splits, {"ws": False})
    assert_close_on_kept_tokens(gen, got, want, single, SINGLE_BOUND)
    dequantised = decode_latent(cache, FP8, 512).to(torch.bfloat16)
    over_bf16 = _run(qn, qr, dequantised, slots, splits, {"ws": True})
    assert_close_on_kept_tokens(gen, got, want, over_bf16, SINGLE_BOUND)


@pytest.mark.parametrize("switches", SWITCHES)
@pytest.mark.parametrize("t,h,k,splits", [(128, 64, 2048, 1), (300, 64, 1984, 1), (40, 40, 1000, None),
                                          (1000, 64, 64, 1), (128, 64, 2048, 4)])
def test_each_switch_gives_the_default_output_bit_for_bit(gen, t, h, k, splits, switches):
    rows, slots, qn, qr = _case(gen, t, h, k, 6000)
    cache = encode_latent(rows.float(), FP8, 512)
    poison_free_memory()
    got = _run(qn, qr, cache, slots, splits, {"ws": "dec", "ws_variant": switches})
    default = _run(qn, qr, cache, slots, splits, {"ws": "dec"})
    assert torch.equal(got, default), f"{switches}: seed {gen.initial_seed()}"
