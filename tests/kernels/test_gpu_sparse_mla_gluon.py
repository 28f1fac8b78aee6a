"""The Gluon sparse MLA (`kernels/gluon_sparse_mla.py`) against the reference and against the Triton kernels on the
same bf16 rows and fp8_ds_mla cache: prefill (one program a token), decode batches (top-k splits merged by the
combine kernel), masked heads, -1 tails and a token with no valid slot, a head-major q as cuBLAS's bmm leaves
it. Needs sm_90 and Gluon (no interpreter runs Gluon: skipped elsewhere). Set-up: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import encode_latent, get_kv_layout
from dsaserve.kernels import gluon_sparse_mla
from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import BF16, DEVICE, poison_free_memory, randn, rel

pytestmark = pytest.mark.skipif(DEVICE != "cuda" or not gluon_sparse_mla.available(torch.device(DEVICE)),
                                reason="the Gluon kernel needs an sm_90 GPU and Gluon")
BF16_LAYOUT, FP8 = get_kv_layout("bf16"), get_kv_layout("fp8_ds_mla")


def _case(gen, t: int, h: int, k: int, n_rows: int, head_major: bool = False):
    rows = randn(n_rows, 576, gen=gen, dtype=torch.bfloat16)
    slots = torch.randint(0, n_rows, (t, k), generator=gen, device=DEVICE, dtype=torch.int32)
    slots[0, k // 3:] = -1  # a short context's -1 tail
    if t > 2:
        slots[1, :] = -1  # no valid slot: zeros
        slots[2, 5:9] = -1  # holes before the end: masked
    if head_major:  # [H, T, 512] transposed, as bmm leaves q_nope
        qn = randn(h, t, 512, gen=gen, dtype=torch.bfloat16).transpose(0, 1)
    else:
        qn = randn(t, h, 512, gen=gen, dtype=torch.bfloat16)
    return rows, slots, qn, randn(t, h, 64, gen=gen, dtype=torch.bfloat16)


def assert_close_on_kept_tokens(gen, got, want, other, other_bound: float) -> None:
    """`_case`'s token 1 (no valid slot) all zeros; the others within BF16 of the reference and within
    other_bound of another kernel's output."""
    t = got.shape[0]
    keep = torch.ones(t, dtype=torch.bool, device=DEVICE)
    if t > 2:
        keep[1] = False
        assert bool((got[1] == 0).all()), "a token without slots gets zeros"
    assert bool(torch.isfinite(got[keep]).all())
    assert rel(got[keep], want[keep]) < BF16, f"seed {gen.initial_seed()}"
    assert rel(got[keep], other[keep]) < other_bound, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("t,h,k,head_major", [(600, 64, 2048, True), (16, 64, 2048, False), (40, 40, 1000, False),
                                              (3, 64, 4096, False)])
def test_gluon_sparse_mla_matches_the_reference(gen, t, h, k, head_major):
    rows, slots, qn, qr = _case(gen, t, h, k, 5000, head_major)
    poison_free_memory()
    out = torch.empty(t, h, 512, dtype=torch.bfloat16, device=DEVICE)
    got = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, out)
    want = R.sparse_mla_attention(qn, qr, rows.view(torch.uint8), BF16_LAYOUT, slots, 0.04, 512)
    keep = torch.ones(t, dtype=torch.bool, device=DEVICE)
    if t > 2:
        keep[1] = False
        assert bool((got[1] == 0).all()), "a token without slots gets zeros"
    assert rel(got[keep], want[keep]) < BF16, f"seed {gen.initial_seed()}"


def test_gluon_sparse_mla_equals_the_triton_kernel_and_is_dispatched(gen):
    """The registry's op (`gluon_sparse_mla.sparse_mla_attention`) takes this kernel for bf16 rows; the Triton
    kernel agrees but for fp32 summation order."""
    from dsaserve.kernels import triton_sparse_mla

    rows, slots, qn, qr = _case(gen, 700, 64, 2048, 20000)
    got = gluon_sparse_mla.sparse_mla_attention(qn, qr, rows.view(torch.uint8), BF16_LAYOUT, slots, 0.04, 512)
    direct = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows, slots, 0.04, torch.empty_like(got))
    assert torch.equal(got, direct)
    triton_out = triton_sparse_mla.sparse_mla_attention(qn, qr, rows.view(torch.uint8), BF16_LAYOUT, slots, 0.04,
                                                        512, config={"grouped": "dequant", "num_stages": 2})
    assert rel(got, triton_out) < BF16 / 10, f"seed {gen.initial_seed()}"


def test_gluon_sparse_mla_rejects_rows_it_does_not_take(gen):
    rows, slots, qn, qr = _case(gen, 16, 64, 256, 300)
    with pytest.raises(ValueError, match="bf16 rows of 576 or fp8_ds_mla bytes of 656"):
        gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, rows[:, :544], slots, 0.04, torch.empty_like(qn))


@pytest.mark.parametrize("t,h,k", [(128, 64, 2048), (16, 64, 1024), (40, 40, 1000), (700, 64, 2048)])
def test_gluon_sparse_mla_over_the_fp8_cache(gen, t, h, k):
    """The fp8_ds_mla kernel (each tile dequantised into shared memory as the Triton kernels round it) against
    the reference and against the Triton fp8 kernel; the registry's op takes it."""
    from dsaserve.kernels import triton_sparse_mla

    rows, slots, qn, qr = _case(gen, t, h, k, 6000)
    cache = encode_latent(rows.float(), FP8, 512)
    poison_free_memory()
    got = gluon_sparse_mla.sparse_mla_attention(qn, qr, cache, FP8, slots, 0.04, 512)
    direct = gluon_sparse_mla.sparse_mla_attention_gluon(qn, qr, cache, slots, 0.04, torch.empty_like(got))
    assert torch.equal(got, direct), "the dispatcher takes the Gluon kernel for the fp8 cache"
    want = R.sparse_mla_attention(qn, qr, cache, FP8, slots, 0.04, 512)
    # the Triton kernel at the Gluon call's split count: the same partial sums, so only P's rounding can differ
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = gluon_sparse_mla.pick_splits(t, -(-h // 64), k, 64, sms)
    triton_out = triton_sparse_mla.sparse_mla_attention(qn, qr, cache, FP8, slots, 0.04, 512,
                                                        config={"grouped": "dequant", "splits": splits})
    assert_close_on_kept_tokens(gen, got, want, triton_out, BF16 / 10)
