"""64-bit offsets (issue 17): the kernels at shapes whose element offsets pass 2^31, on a GPU only (tens of GB).

`bench_gpu.py --prefill 131072` died in sparse MLA with an illegal address: q_nope comes out of cuBLAS's bmm
head-major ([H, T, 512] transposed), so at T = 131072 head h's offset is h * 2^26 and wrapped in int32 from
head 32 on. Each case here builds the largest such layout GLM-5.3 produces (a 131072-token chunk, 64 heads)
and checks a few rows, the last ones included, against the reference.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import encode_latent
from dsaserve.kernels import reference as R
from dsaserve.weights.fp8 import quantize_fp8_block
from tests.kernels.gpu_common import BF16, DEVICE, FP8A, gpu_modules, randn, rel

pytestmark = pytest.mark.skipif(DEVICE != "cuda", reason="tens of GB of device memory")
INT32_LIMIT = 2 ** 31


def _rows(n: int) -> torch.Tensor:
    """A few rows to check: the first, some in the middle, the last."""
    return torch.tensor([0, 1, n // 2, n - 2, n - 1], device=DEVICE)


def test_sparse_mla_takes_a_131072_token_prefill_with_head_major_queries(gen):
    mla = gpu_modules()[4]
    t, h, dc, dr, k, n_slots = 131072, 64, 512, 64, 64, 4096
    q_nope = torch.empty(h, t, dc, dtype=torch.bfloat16, device=DEVICE).normal_(generator=gen).transpose(0, 1)
    assert q_nope.stride(1) * (h - 1) + q_nope.stride(0) * (t - 1) + dc > INT32_LIMIT
    q_rope = randn(t, h, dr, gen=gen, dtype=torch.bfloat16)
    cache = encode_latent(randn(n_slots, dc + dr, gen=gen), "fp8_ds_mla", dc)
    slots = torch.randint(0, n_slots, (t, k), generator=gen, device=DEVICE)
    got = mla.sparse_mla_attention(q_nope, q_rope, cache, "fp8_ds_mla", slots, 0.04, dc)
    rows = _rows(t)
    ref = R.sparse_mla_attention(q_nope[rows], q_rope[rows], cache, "fp8_ds_mla", slots[rows], 0.04, dc)
    assert rel(got[rows], ref) < BF16, f"seed {gen.initial_seed()}"


def test_sparse_mla_over_staged_bf16_rows_takes_a_131072_token_prefill(gen):
    """A prefill's staged rows are bf16: on sm_90 the warp-specialised Gluon kernel takes this call (unsplit, from
    512 tokens); head-major queries as above, and an output whose offsets pass 2^31 too."""
    mla = gpu_modules()[4]
    t, h, dc, dr, k, n_slots = 131072, 64, 512, 64, 64, 4096
    q_nope = torch.empty(h, t, dc, dtype=torch.bfloat16, device=DEVICE).normal_(generator=gen).transpose(0, 1)
    q_rope = randn(t, h, dr, gen=gen, dtype=torch.bfloat16)
    rows_bf16 = randn(n_slots, dc + dr, gen=gen, dtype=torch.bfloat16)
    slots = torch.randint(0, n_slots, (t, k), generator=gen, device=DEVICE)
    got = mla.sparse_mla_attention(q_nope, q_rope, rows_bf16.view(torch.uint8), "bf16", slots, 0.04, dc)
    assert got.numel() > INT32_LIMIT
    rows = _rows(t)
    ref = R.sparse_mla_attention(q_nope[rows], q_rope[rows], rows_bf16.view(torch.uint8), "bf16", slots[rows], 0.04,
                                 dc)
    assert rel(got[rows], ref) < BF16, f"seed {gen.initial_seed()}"


def test_activation_quantiser_takes_more_than_2_31_values(gen):
    """The prefill MoE's down-projection input [T*k, I] (131072 x 8 x 2048 = 2^31) and beyond."""
    gemm = gpu_modules()[0]
    m, k = INT32_LIMIT // 2048 + 64, 2048
    x = torch.empty(m, k, dtype=torch.bfloat16, device=DEVICE).normal_(generator=gen)
    q, s = gemm.quant_act_fp8(x)
    rows = _rows(m)
    ref_q, ref_s = gemm.quant_act_fp8(x[rows])
    torch.testing.assert_close(s[rows], ref_s)
    assert torch.equal(q[rows].view(torch.uint8), ref_q.view(torch.uint8))


def test_triton_gemm_writes_an_output_of_more_than_2_31_values(gen):
    """The Triton block-scaled GEMM (prefill shapes cuBLAS's block scaling does not take) with M x N > 2^31."""
    gemm = gpu_modules()[0]
    m, n, k = INT32_LIMIT // 4096 + 64, 4096, 256
    w, s = quantize_fp8_block(randn(n, k, gen=gen))
    x = randn(m, k, gen=gen, dtype=torch.bfloat16)
    got = gemm.triton_gemm(x, w, s, True, 64, 128, 1, 4, 3, torch.bfloat16)
    rows = _rows(m)
    assert rel(got[rows], R.fp8_linear(x[rows], w, s)) < FP8A, f"seed {gen.initial_seed()}"
