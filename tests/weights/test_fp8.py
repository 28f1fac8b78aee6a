"""FP8 e4m3 block quantisation: scales, round-trip error bound, partial blocks, stacked experts, errors.

The bound asserted per element x of a block with scale s = amax/448 (so x/s lies in [-448, 448]):
  |dequant(quant(x)) - x| <= 2^-4 * |x| + 2^-10 * s
e4m3 has 3 mantissa bits, so round-to-nearest on a normal value (|x/s| >= 2^-6) is off by at most half
an ulp = 2^-4 of the value; below 2^-6 the subnormal spacing is 2^-9, so the error is at most 2^-10 in
units of s. The sum of the two terms covers both ranges. Blocks get magnitudes 10^-3..10^3 apart, so a
scale applied to the wrong block breaks the bound by orders of magnitude.
"""

import math

import pytest
import torch

from dsaserve.weights.fp8 import FP8_MAX, dequantize_fp8_block, quantize_fp8_block


def _blocky(shape, seed=0):
    """Random weight whose 128x128 blocks have very different magnitudes (1e-3 .. 1e3)."""
    g = torch.Generator().manual_seed(seed)
    *lead, n, k = shape
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    mag = 10.0 ** (torch.rand(*lead, nb, kb, generator=g) * 6 - 3)
    full = mag.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]
    return torch.randn(shape, generator=g) * full


def _per_element_scale(scale_inv, n, k):
    return scale_inv.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]


def _assert_within_e4m3_bound(w, q, s):
    n, k = w.shape[-2:]
    err = (dequantize_fp8_block(q, s) - w).abs()
    bound = 2.0**-4 * w.abs() + 2.0**-10 * _per_element_scale(s, n, k)
    assert (err <= bound * (1 + 1e-6)).all(), f"max err/bound {(err / bound).max().item():.3f}"
    # ...and the bound is not vacuous: rounding really happens at about that size
    assert (err / bound).max() > 0.5


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (1, 1), (129, 127), (64, 1000)])
def test_round_trip_error_is_within_e4m3_bound_per_block(shape):
    w = _blocky(shape)
    q, s = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32 and s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    if w.numel() > 1:
        _assert_within_e4m3_bound(w, q, s)
    else:
        assert torch.allclose(dequantize_fp8_block(q, s), w, rtol=1e-6)


def test_scale_is_block_amax_over_448_including_partial_edge_blocks():
    w = _blocky((200, 260), seed=1)
    _, s = quantize_fp8_block(w)
    for i in range(2):
        for j in range(3):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert s[i, j].item() == pytest.approx(block.abs().max().item() / 448.0, rel=1e-6)


def test_block_maximum_maps_to_448_and_back_exactly():
    w = _blocky((256, 256), seed=2)
    q, s = quantize_fp8_block(w)
    assert q.float().abs().max().item() == FP8_MAX
    deq = dequantize_fp8_block(q, s)
    idx = w.abs().argmax()
    assert deq.flatten()[idx].item() == pytest.approx(w.flatten()[idx].item(), rel=1e-6)


def test_all_zero_block_gets_a_finite_scale_and_decodes_to_zero():
    w = _blocky((256, 256), seed=3)
    w[:128, 128:] = 0
    q, s = quantize_fp8_block(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    deq = dequantize_fp8_block(q, s)
    assert (deq[:128, 128:] == 0).all()
    assert torch.isfinite(deq).all()


def test_stacked_experts_3d_match_per_expert_quantisation():
    w = _blocky((3, 200, 300), seed=4)
    q, s = quantize_fp8_block(w)
    assert q.shape == (3, 200, 300) and s.shape == (3, 2, 3)
    deq = dequantize_fp8_block(q, s)
    for e in range(3):
        qe, se = quantize_fp8_block(w[e])
        assert torch.equal(q[e].view(torch.uint8), qe.view(torch.uint8))
        assert torch.equal(s[e], se)
        assert torch.equal(deq[e], dequantize_fp8_block(qe, se))
        _assert_within_e4m3_bound(w[e], qe, se)


def test_bf16_input_and_bf16_output():
    w = _blocky((130, 130), seed=5).to(torch.bfloat16)
    q, s = quantize_fp8_block(w)
    out = dequantize_fp8_block(q, s, dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, dequantize_fp8_block(q, s).to(torch.bfloat16))


def test_dequantize_rejects_scale_of_wrong_shape_naming_both_shapes():
    q, s = quantize_fp8_block(torch.randn(300, 200))
    with pytest.raises(ValueError, match=r"q_proj.*\(2, 2\).*expected \(3, 2\).*\(300, 200\)"):
        dequantize_fp8_block(q, s[:2], name="q_proj")
    with pytest.raises(ValueError, match="transposed"):
        dequantize_fp8_block(q, s.t(), name="transposed")


def test_dequantize_rejects_scale_with_wrong_number_of_dims():
    q, s = quantize_fp8_block(torch.randn(2, 128, 128))
    with pytest.raises(ValueError, match="experts.*2 dims.*3"):
        dequantize_fp8_block(q, s[0], name="experts")


def test_quantize_rejects_vectors_integers_and_non_finite_values():
    with pytest.raises(ValueError, match=r"shape \(5,\)"):
        quantize_fp8_block(torch.randn(5))
    with pytest.raises(ValueError, match="float"):
        quantize_fp8_block(torch.ones(4, 4, dtype=torch.int32))
    bad = torch.randn(4, 4)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match="inf or NaN"):
        quantize_fp8_block(bad)
