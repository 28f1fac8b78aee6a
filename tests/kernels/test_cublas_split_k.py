"""cuBLAS's GEMM split along K (`kernels/cublas_split_k.py`): how many parts a shape gets, and that the parts'
views, scales and sum give the whole product. On the CPU a dequantising matmul stands in for `_scaled_mm` (same
arguments: 1x128 activation scales outer-dim-major, the part's contiguous 128x128 weight scales transposed); the
GPU test (`test_gpu_gemm_moe.py`) runs cuBLAS itself on concurrent streams."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels import cublas_split_k as S


@pytest.mark.parametrize(("m", "n", "k", "want"), [
    (128, 6144, 16384, 2),  # o_proj: 48 tiles, 2 x 48 within 132 SMs
    (128, 2816, 6144, 4),  # qkv_a: 22 tiles, up to 4 parts (6144 = 4 x 1536, whole 512s)
    (128, 6144, 12288, 2),  # the dense down
    (128, 16384, 2048, 1),  # q_b: 128 tiles fill the SMs already
    (256, 6144, 16384, 1),  # 96 tiles: past half the SMs
    (512, 2816, 6144, 1),  # past MAX_ROWS: a prefill
    (128, 6144, 2048, 2),  # the shared down: 2 x 1024 (2048 is no multiple of 3 x 512)
    (128, 1024, 1536, 3),  # 8 tiles: 4 parts would not be whole 512s, 3 are
])
def test_split_count_fills_a_wave_in_whole_512_columns(m, n, k, want, monkeypatch):
    monkeypatch.setattr(S, "ENABLED", True)
    assert S.split_count(m, n, k, 132) == want


def test_split_count_is_one_when_switched_off(monkeypatch):
    monkeypatch.setattr(S, "ENABLED", False)
    assert S.split_count(128, 6144, 16384, 132) == 1


def _fake_scaled_mm(a, b, scale_a, scale_b, out_dtype, out):
    """`_scaled_mm`'s block scaling in float32: a [M, K] x 1x128 scales [M, K/128], b [K, N] x 128x128 scales."""
    assert scale_b.is_contiguous() is False and scale_b.t().is_contiguous()  # a part's own dense scales
    a_deq = a.float() * scale_a.repeat_interleave(128, 1)
    b_deq = b.float() * scale_b.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return out.copy_((a_deq @ b_deq).to(out_dtype))


@pytest.mark.parametrize("splits", [2, 3, 4])
def test_the_parts_sum_to_the_whole_product(splits):
    gen = torch.Generator().manual_seed(splits)
    m, n, k = 32, 256, 1536 * 4 if splits != 3 else 1536
    a = torch.randn(m, k, generator=gen).to(torch.float8_e4m3fn)
    a_s = torch.rand(k // 128, m, generator=gen).t() + 0.5  # outer-dim-major, as quant_act_fp8 lays it out
    w = torch.randn(n, k, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(n // 128, k // 128, generator=gen) + 0.5
    got = S.split_scaled_mm(a, a_s, w, scale, splits, mm=_fake_scaled_mm, streams=[])
    want = (a.float() * a_s.repeat_interleave(128, 1)) @ (w.float() * scale.repeat_interleave(128, 0)
                                                         .repeat_interleave(128, 1)).t()
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    # each part rounded to bf16 once before the sum: within a few bf16 steps of the float32 product
    torch.testing.assert_close(got.float(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())
    assert S.part_scales(scale, splits)[0].is_contiguous()


def test_part_scales_are_made_once_for_every_valid_count():
    scale = torch.rand(4, 48)  # K = 6144: 2, 3 and 4 parts are whole 512s
    first = S.part_scales(scale, 2)
    assert S.part_scales(scale, 2) is first and S.part_scales(scale, 3) is not None
    assert [p.shape[1] for p in S.part_scales(scale, 4)] == [12] * 4
    assert torch.equal(torch.cat(first, dim=1), scale)


def test_prepare_makes_the_part_scales_on_any_eager_call_and_nothing_while_off(monkeypatch):
    """A warm start runs only its largest bucket eagerly, where o_proj may split nothing: its part scales must be
    made there all the same, or every graph captured after runs it whole."""
    scale = torch.rand(48, 128)  # o_proj's [N/128, K/128]
    monkeypatch.setattr(S, "ENABLED", False)
    S.prepare(scale)
    assert S._PART_SCALES.get(scale) is None
    monkeypatch.setattr(S, "ENABLED", True)
    S.prepare(scale)
    assert sorted(S._PART_SCALES.get(scale)[0]) == [2, 4]  # 16384 = 2 x 8192 = 4 x 4096, not 3 whole 512s
