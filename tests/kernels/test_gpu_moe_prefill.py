"""The fused MoE prefill path (`triton_moe_prefill`: permute + quantise, dense grouped FP8 GEMMs, un-permuting
combine) against `reference.fused_moe`, over its tilings, skewed routing with an expert nobody chose, absent
experts, shapes off the 128 grid, and its pieces against their unfused equivalents.
Set-up and error bounds: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels import reference as R
from dsaserve.weights.fp8 import quantize_fp8_block
from tests.kernels.gpu_common import (
    BIG,
    DEVICE,
    FP8A,
    MODELS,
    gpu_modules,
    poison_free_memory,
    randn,
    rel,
    requires_gpu_kernels,
)

pytestmark = requires_gpu_kernels

# (E, H, I, k): H and I multiples of 128, and both off the 128 grid (partial K steps, up rows starting
# inside a weight scale block, a partial last act quant group)
SHAPES = [(8, 1024, 512, 8), (6, 640, 320, 4)] if BIG else [(4, 256, 128, 2), (3, 320, 192, 2)]
CONFIGS = {  # block_m small so the toy batches still make several blocks an expert
    "default": {},
    "promote": {"mma_acc": False},
    "unfused-quant": {"bn1": 64, "bn2": 64},
    "pointer-persistent": {"tma": False, "persistent": True, "group_m": 2},
    "bn2-256": {"bn2": 256, "warps2": 8},
    "slot-permute": {"permute": "slot"},
    "pair2-mma2": {"pair_n2": True, "mma_acc2": True},  # GEMM2 2x128-column tiles (N off 256 in SHAPES[1])
    "pair2-promote-persistent-flatten": {"pair_n2": True, "persistent": True, "flatten": True, "group_m": 2},
    "lag": {"lag": True},  # both GEMMs: the promotion one K step late
    "lag2-unfused-quant": {"lag2": True, "bn1": 64, "bn2": 64},
}


def _weights(gen, e, h, inter):
    (w13, s13), (w2, s2) = (quantize_fp8_block(randn(e, 2 * inter, h, gen=gen, scale=0.05)),
                            quantize_fp8_block(randn(e, h, inter, gen=gen, scale=0.05)))
    return w13, s13, w2, s2


def _route(gen, t, e, k, dist):
    """(weights [T, k] fp32, ids [T, k] int64): uniform, or skewed (expert 0 takes most, expert 1 none)."""
    probs = torch.ones(e, device=DEVICE)
    if dist == "skewed":
        probs = torch.linspace(8.0, 1.0, e, device=DEVICE)
        probs[1] = 0.0
    ids = torch.multinomial(probs.expand(t, e), k, replacement=False, generator=gen)
    tw = torch.rand(t, k, generator=gen, device=DEVICE) + 0.1
    return tw, ids


def _problem(gen, shape: tuple, t: int, dist: str):
    """(weights, x [t, H] bf16, routing weights, ids) of one MoE call of `shape` = (E, H, I, k)."""
    e, h, inter, k = shape
    return (_weights(gen, e, h, inter), randn(t, h, gen=gen, dtype=torch.bfloat16), *_route(gen, t, e, k, dist))


def _dense(conf: dict) -> dict:
    return {"kernel": "dense", "block_m": 32 if BIG else 16, **conf}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dist", ["uniform", "skewed"])
def test_dense_moe_matches_reference_in_every_tiling(gen, shape, dist):
    moe = gpu_modules()[3]
    w, x, tw, ids = _problem(gen, shape, 300 if BIG else 37, dist)
    ref = R.fused_moe(x, *w[:2], *w[2:], tw, ids)
    for name, conf in CONFIGS.items():
        poison_free_memory()
        got = moe.fused_moe(x, *w[:2], *w[2:], tw, ids, config=_dense(conf))
        assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got).all(), name
        assert rel(got, ref) < FP8A, f"seed {gen.initial_seed()} {name}"


def test_fused_moe_runs_the_dense_path_from_the_prefill_size(gen, monkeypatch):
    moe = gpu_modules()[3]
    from dsaserve.kernels import triton_moe_prefill as P

    e, h, inter, k = SHAPES[0]
    w = _weights(gen, e, h, inter)
    x = randn(20, h, gen=gen, dtype=torch.bfloat16)
    tw, ids = _route(gen, 20, e, k, "uniform")
    monkeypatch.setattr(moe, "PREFILL_MIN_PAIRS", 16)
    monkeypatch.setitem(P.PREFILL_CONFIG, "block_m", 16)
    calls = []
    real = moe.moe_prefill_fp8
    monkeypatch.setattr(moe, "moe_prefill_fp8", lambda *a: calls.append(a[-1]) or real(*a))
    got = moe.fused_moe(*[x, *w[:2], *w[2:], tw, ids])
    assert len(calls) == 1 and calls[0]["block_m"] == 16
    assert rel(got, R.fused_moe(x, *w[:2], *w[2:], tw, ids)) < FP8A, f"seed {gen.initial_seed()}"
    monkeypatch.setitem(P.PREFILL_CONFIG, "kernel", "gemm")  # the flip back to the gather kernel
    moe.fused_moe(*[x, *w[:2], *w[2:], tw, ids])
    assert len(calls) == 1


def test_dense_moe_skips_absent_experts_and_adds_the_shared_output(gen):
    moe = gpu_modules()[3]
    e, h, inter, k = SHAPES[0]
    w = _weights(gen, e, h, inter)
    t = 29
    x = randn(t, h, gen=gen, dtype=torch.bfloat16)
    tw, ids = _route(gen, t, e, k, "uniform")
    ids = torch.where(ids % 2 == 1, torch.full_like(ids, e), ids)  # odd experts live on another rank
    ref = R.fused_moe(x, *w[:2], *w[2:], tw, ids, absent=True)
    poison_free_memory()
    got = moe.fused_moe(x, *w[:2], *w[2:], tw, ids, config=_dense({}), absent=True)
    assert torch.isfinite(got).all() and rel(got, ref) < FP8A, f"seed {gen.initial_seed()}"
    shared = randn(t, h, gen=gen, dtype=torch.bfloat16)
    with_add = moe.fused_moe(x, *w[:2], *w[2:], tw, ids, add=shared, config=_dense({}), absent=True)
    assert torch.equal(with_add, got + shared)


@pytest.mark.parametrize("mode", ["token", "slot"])
def test_permute_quant_writes_the_sorted_quantised_rows_and_their_positions(gen, mode):
    gpu_modules()
    from dsaserve.kernels import triton_fp8_gemm as G
    from dsaserve.kernels import triton_moe_align as A
    from dsaserve.kernels import triton_moe_prefill as P

    t, e, h, k, bm = 23, 5, 320, 3, 16
    x = randn(t, h, gen=gen, dtype=torch.bfloat16)
    _, ids = _route(gen, t, e, k, "skewed")
    ids[3, 1] = e  # an absent expert's pair: no row, pos -1
    route = A.align_route(ids, e, bm)
    q, s, pos = P.permute_quant(x, route, k, mode)
    total = int(route[2])
    sorted_ids = route[0][:total].long()
    real = sorted_ids < t * k
    want_q, want_s = G.quant_act_fp8(x)
    rows = torch.where(real, sorted_ids // k, 0)
    assert torch.equal(q[:total][real].view(torch.uint8), want_q[rows[real]].view(torch.uint8))
    assert torch.equal(s.t()[:total][real], want_s[rows[real]])
    if mode == "slot":  # the token mode leaves padding rows unwritten
        assert (q[:total][~real].float() == 0).all()
    assert int(pos[3 * k + 1]) == -1 and torch.equal(pos, route[3])
    live = pos >= 0
    assert torch.equal(pos[live].long().sort().values, torch.nonzero(real).flatten())  # each live pair once
    assert torch.equal(sorted_ids[pos[live].long()], torch.nonzero(live).flatten())


def test_gemm1_quantised_epilogue_equals_quantising_its_bf16_output(gen):
    """The fused act quantiser writes the bytes `quant_act_fp8` would write from the unfused bf16 act."""
    moe = gpu_modules()[3]
    from dsaserve.kernels import triton_fp8_gemm as G
    from dsaserve.kernels import triton_moe_prefill as P

    e, h, inter, k = SHAPES[1]  # I off the 128 grid: a partial last quant group
    w13, s13, _, _ = _weights(gen, e, h, inter)
    t = 19
    x = randn(t, h, gen=gen, dtype=torch.bfloat16)
    _, ids = _route(gen, t, e, k, "skewed")
    cfg = {**P.PREFILL_CONFIG, "block_m": 16}
    route = moe.align_route(ids, e, 16)
    a1, a1_s, _ = P.permute_quant(x, route, k)
    rows, total = a1.shape[0], int(route[2])
    act8 = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=DEVICE)
    act8_s = torch.empty(-(-inter // 128), rows, device=DEVICE)
    P.grouped_gemm(a1, a1_s, w13, s13, act8, act8_s, route, inter, True, cfg, 1)
    act16 = torch.empty(rows, inter, dtype=torch.bfloat16, device=DEVICE)
    P.grouped_gemm(a1, a1_s, w13, s13, act16, None, route, inter, True, {**cfg, "bn1": 64}, 1)
    want_q, want_s = G.quant_act_fp8(act16[:total])
    assert torch.equal(act8[:total].view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(act8_s[:, :total].t(), want_s)


@pytest.mark.parametrize("model", MODELS)
def test_dense_moe_takes_each_models_shapes(gen, model):
    cfg, moe = MODELS[model], gpu_modules()[3]
    e, h, inter, k = min(cfg.n_routed_experts, 8), cfg.hidden_size, cfg.moe_intermediate_size, \
        min(cfg.num_experts_per_tok, 4)
    w = _weights(gen, e, h, inter)
    x = randn(9, h, gen=gen, dtype=torch.bfloat16)
    tw, ids = _route(gen, 9, e, k, "skewed")
    got = moe.fused_moe(x, *w[:2], *w[2:], tw, ids, config=_dense({}))
    assert rel(got, R.fused_moe(x, *w[:2], *w[2:], tw, ids)) < FP8A, f"seed {gen.initial_seed()} {model}"


# ---- the cuBLAS variant (`cublas_moe_prefill`): a block-scaled _scaled_mm an expert ------------------------
CUBLAS_SHAPE = (5, 1024, 512, 4) if BIG else (3, 512, 512, 2)  # H, I multiples of 512: cuBLAS's block scaling


def _emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype, out):
    """torch._scaled_mm's DeepSeek block scaling, checked as torch checks it (ScaledBlas.cpp): a (M, K) e4m3
    row-major, b (K, N) column-major, scale_a (M, K/128) with stride (1, M), scale_b (K/128, N/128) the
    transpose of a row-major (N/128, K/128); out an (M, N) contiguous block. Dequantised product in fp32."""
    (m, k), n = a.shape, b.shape[1]
    kg = -(-k // 128)
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride() == (k, 1) and b.stride() == (1, k)
    assert scale_a.shape == (m, kg) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    assert scale_b.shape == (kg, n // 128) and scale_b.stride() == (1, kg)
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == out_dtype
    deq_a = a.float() * scale_a.repeat_interleave(128, dim=1)[:, :k]
    deq_b = b.float() * scale_b.repeat_interleave(128, dim=0)[:k].repeat_interleave(128, dim=1)[:, :n]
    out.copy_(deq_a @ deq_b)
    return out


@pytest.fixture
def cublas(monkeypatch):
    """The cuBLAS module, its GEMM emulated off CUDA (the interpreter runs the Triton kernels around it)."""
    gpu_modules()
    from dsaserve.kernels import cublas_moe_prefill as C

    if DEVICE != "cuda":
        monkeypatch.setattr(C, "scaled_mm", _emulated_scaled_mm)
    return C


@pytest.mark.parametrize("dist", ["uniform", "skewed"])
def test_cublas_moe_matches_reference(gen, cublas, dist):
    moe = gpu_modules()[3]
    t, (e, h) = 300 if BIG else 29, CUBLAS_SHAPE[:2]
    w, x, tw, ids = _problem(gen, CUBLAS_SHAPE, t, dist)
    ids[::5, 0] = e  # pairs of another rank's expert: no row, nothing added
    ref = R.fused_moe(x, *w[:2], *w[2:], tw, ids, absent=True)
    shared = randn(t, h, gen=gen, dtype=torch.bfloat16)
    poison_free_memory()
    conf = _dense({"gemm": "cublas"})
    got = moe.fused_moe(x, *w[:2], *w[2:], tw, ids, config=conf, absent=True)
    assert torch.isfinite(got).all() and rel(got, ref) < FP8A, f"seed {gen.initial_seed()}"
    with_add = moe.fused_moe(x, *w[:2], *w[2:], tw, ids, add=shared, config=conf, absent=True)
    assert torch.equal(with_add, got + shared)
    triton_path = moe.fused_moe(x, *w[:2], *w[2:], tw, ids, config=_dense({"gemm": "triton"}), absent=True)
    assert rel(got, triton_path) < FP8A / 2, f"seed {gen.initial_seed()}"  # the two GEMMs agree closer still


def test_cublas_moe_scales_lie_in_one_block_an_expert(gen, cublas):
    """Each expert's activation scales are the [K/128, rows] block `_scaled_mm` reads for its rows, holding
    `quant_act_fp8`'s scales of those rows; the act quantiser keeps GEMM1's epilogue rule (bf16, then e4m3)."""
    from dsaserve.kernels import triton_fp8_gemm as G
    from dsaserve.kernels import triton_moe_align as A

    t, e, h, k, bm = 23, 5, 384, 3, 16
    x = randn(t, h, gen=gen, dtype=torch.bfloat16)
    _, ids = _route(gen, t, e, k, "skewed")
    route = A.align_route(ids, e, bm)
    q, s = cublas.quant_scatter_segments(x, route, k, bm)
    runs = cublas.expert_runs(*cublas.run_bounds(route[4]))
    assert [r[0] for r in runs] == sorted({int(i) for i in ids.flatten()})  # every chosen expert, once
    want_q, want_s = G.quant_act_fp8(x)
    for _, start, rows in runs:
        sids = route[0][start:start + rows].long()
        real = sids < t * k
        scales = cublas.expert_scales(s, start, rows, h)
        assert scales.stride() == (1, rows)
        assert torch.equal(scales[real], want_s[sids[real] // k]), f"seed {gen.initial_seed()}"
        assert torch.equal(q[start:start + rows][real].view(torch.uint8), want_q[sids[real] // k].view(torch.uint8))
    h13 = randn(route[0].numel(), 2 * h, gen=gen, dtype=torch.bfloat16)
    act, act_s = cublas.silu_mul_quant_segments(h13, route, bm)
    total = int(route[2])
    gate, up = h13[:total, :h].float(), h13[:total, h:].float()
    want_q, want_s = G.quant_act_fp8((gate * torch.sigmoid(gate) * up).bfloat16())
    assert torch.equal(act[:total].view(torch.uint8), want_q.view(torch.uint8))
    for _, start, rows in runs:
        assert torch.equal(cublas.expert_scales(act_s, start, rows, h), want_s[start:start + rows])


def test_auto_takes_cublas_only_where_it_may_run(gen, cublas, monkeypatch):
    from dsaserve.kernels import triton_moe_prefill as P

    e, h, inter = 32, 6144, 2048
    x = torch.empty(8, h, dtype=torch.bfloat16, device=DEVICE)
    cfg = {**P.PREFILL_CONFIG, "gemm": "auto", "cublas_min_rows": 512}
    on_h200 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)
    assert cublas.use_cublas(cfg, x, e, inter, 512 * e) == on_h200
    assert not cublas.use_cublas(cfg, x, e, inter, 512 * e - 1)  # fewer rows an expert: the Triton grouped GEMM
    assert not cublas.use_cublas(cfg, x, e, inter + 128, 512 * e)  # I not a multiple of 512
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not cublas.use_cublas(cfg, x, e, inter, 1 << 20)  # a CUDA graph cannot read sizes on the host
    assert cublas.use_cublas({**cfg, "gemm": "cublas"}, x, e, inter, 1)
    with pytest.raises(ValueError, match="multiples of 512"):
        cublas.use_cublas({**cfg, "gemm": "cublas"}, x, e, 320, 1)
    with pytest.raises(ValueError, match="is one of"):
        cublas.use_cublas({**cfg, "gemm": "cutlass"}, x, e, inter, 1)
