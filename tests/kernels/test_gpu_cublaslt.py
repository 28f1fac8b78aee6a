"""cuBLASLt called directly (`kernels/cublaslt.py`): every candidate algorithm of the heuristic computes the product
`_scaled_mm` / `F.linear` compute, eagerly and replayed from a CUDA graph; the struct sizes match cublasLt.h."""

import ctypes
import gc

import pytest
import torch

from dsaserve.kernels import cublaslt

gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                         reason="cuBLASLt's block-scaled FP8: a Hopper GPU")


def test_structs_match_the_header():
    # cublasLt.h: cublasLtMatmulAlgo_t is uint64_t[8]; the heuristic result adds size_t, int, float, int[4]
    assert ctypes.sizeof(cublaslt.Algo) == 64 and ctypes.sizeof(cublaslt.HeuristicResult) == 96


def _fp8_case(m: int, n: int, k: int):
    from dsaserve.kernels.triton_fp8_gemm import quant_act_fp8

    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(n // 128, k // 128, device="cuda", generator=gen) * 1e-2 + 1e-3
    a, a_s = quant_act_fp8(x, pad_m_to=16, scale_m_major=True)
    return a, a_s, w, s, torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=s.t(), out_dtype=torch.bfloat16)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want.float()).norm() / want.float().norm()).item())


def _captured(fn):
    """fn() captured in a CUDA graph (where the tuned calls run: `cublaslt_tuning._usable`) and replayed once: its
    output (None where fn returned None in the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


@gpu
@pytest.mark.parametrize("m,n,k", [(128, 6144, 16384), (64, 2816, 6144), (128, 4096, 6144), (48, 6144, 2048)])
def test_every_fp8_candidate_matches_scaled_mm(m, n, k):
    a, a_s, w, s, want = _fp8_case(m, n, k)
    gemm = cublaslt.Gemm(a.shape[0], n, k, fp8=True)
    cands = gemm.algos(16, a_s, s)
    assert cands, "the heuristic offered no algorithm"
    y = torch.empty_like(want)
    for cand in cands:  # (the first is not torch's: with a 32 MB workspace it may split K where torch's does not)
        # split K sums in another order: fp32 partials, one bf16 rounding (2^-9 relative at most)
        assert _rel(gemm.run(cand.algo, a, w, y, x_scale=a_s, w_scale=s), want) < 4e-3, cand.config()


@gpu
def test_replayed_from_a_graph_equals_eager():
    a, a_s, w, s, want = _fp8_case(128, 6144, 16384)
    gemm = cublaslt.Gemm(128, 6144, 16384, fp8=True)
    algo = gemm.algos(16, a_s, s)[-1].algo
    y = torch.empty_like(want)
    eager = gemm.run(algo, a, w, y, x_scale=a_s, w_scale=s).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemm.run(algo, a, w, y, x_scale=a_s, w_scale=s)
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager)


@gpu
def test_bf16_candidates_match_linear():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8, 1024, device="cuda", generator=gen).bfloat16()
    w = torch.randn(4096, 1024, device="cuda", generator=gen).bfloat16()
    want = torch.nn.functional.linear(x, w)
    gemm = cublaslt.Gemm(8, 4096, 1024, fp8=False)
    y = torch.empty_like(want)
    for cand in gemm.algos(8):
        assert _rel(gemm.run(cand.algo, x, w, y), want) < 4e-3, cand.config()


@gpu
def test_a_wrong_shape_is_refused_by_name():
    gemm = cublaslt.Gemm(16, 256, 512, fp8=False)
    x = torch.zeros(16, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="Gemm"):
        gemm.run(None, x, torch.zeros(256, 512, device="cuda", dtype=torch.bfloat16),
                 torch.empty(16, 256, device="cuda", dtype=torch.bfloat16))


@gpu
def test_a_dropped_gemm_frees_its_descriptors_and_others_still_run():
    gemm = cublaslt.Gemm(16, 256, 512, fp8=False)
    finalizer = gemm._finalizer
    del gemm
    gc.collect()
    assert not finalizer.alive  # _destroy ran (no reference cycle keeps a Gemm)
    x = torch.ones(16, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(256, 512, device="cuda", dtype=torch.bfloat16)
    again = cublaslt.Gemm(16, 256, 512, fp8=False)
    y = again.run(None, x, w, torch.empty(16, 256, device="cuda", dtype=torch.bfloat16))
    assert torch.equal(y, torch.full_like(y, 512))


def test_row_classes_and_the_switch():
    from dsaserve.kernels import cublaslt_tuning as T

    assert [T.row_class(m) for m in (33, 64, 65, 128, 129, 512, 513)] == [64, 64, 128, 128, 256, 512, None]
    saved = T.TUNED
    try:
        T.TUNED = False  # off: the caller runs `_scaled_mm`, whatever was timed
        assert T.linear(torch.zeros(64, 512), torch.zeros(64, 4), torch.zeros(256, 512), torch.zeros(2, 4)) is None
    finally:
        T.TUNED = saved


@gpu
def test_tuned_projection_equals_scaled_mm_at_every_row_count_of_its_class():
    from dsaserve.kernels import cublaslt_tuning as T

    report = T.tune([(6144, 16384)], 128, torch.device("cuda"))
    assert {r["m"] for r in report["shapes"]} == {64, 128}
    assert all(r["best_us"] * T.MIN_GAIN <= r["torch_us"] for r in report["shapes"] if r["chosen"] is not None)
    assert report["chosen"] == sum(r["chosen"] is not None for r in report["shapes"])
    saved = T.TUNED
    try:
        T.TUNED = True
        for m in (48, 64, 80, 128):
            a, a_s, w, s, want = _fp8_case(m, 6144, 16384)
            assert T.linear(a, a_s, w, s) is None  # eager: torch's call (the ctypes host time would cost more)
            got = _captured(lambda a=a, a_s=a_s, w=w, s=s: T.linear(a, a_s, w, s))
            chosen = next(r["chosen"] for r in report["shapes"] if r["m"] == T.row_class(m))
            if chosen is None:
                assert got is None  # nothing beat `_scaled_mm`: the caller runs it
            elif got is not None:  # (an algorithm may not run every row count of its class: then None too)
                assert _rel(got, want) < 4e-3
    finally:
        T.TUNED = saved


@gpu
def test_tuned_lm_head_equals_mm():
    from dsaserve.kernels import cublaslt_tuning as T

    gen = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(8192, 1024, device="cuda", generator=gen).bfloat16()
    report = T.tune([], 2, torch.device("cuda"), w)
    assert [r["m"] for r in report["shapes"]] == [1, 2] and all(r["dtype"] == "bf16" for r in report["shapes"])
    saved = T.TUNED
    try:
        T.TUNED = True
        for r in report["shapes"]:
            h = torch.randn(r["m"], 1024, device="cuda", generator=gen).bfloat16()
            out = torch.empty(r["m"], 8192, device="cuda", dtype=torch.bfloat16)
            got = _captured(lambda h=h, out=out: T.lm_head(h, w, out))
            assert (got is None) == (r["chosen"] is None)
            if got is not None:
                assert got.data_ptr() == out.data_ptr() and _rel(got, h @ w.t()) < 4e-3
    finally:
        T.TUNED = saved


def test_projection_shapes_are_the_fp8_linears_cublas_takes():
    from dsaserve.engine.gemm_tuning import projection_shapes
    from dsaserve.model.layers.linear import Linear

    model = torch.nn.ModuleList([Linear(2048, 512, quantized=True), Linear(2048, 512, quantized=True),
                                 Linear(256, 512, quantized=True),  # K/128 = 2: not cuBLAS's (scaled_mm_shape_ok)
                                 Linear(2048, 640, quantized=False)])  # bf16: not an FP8 projection
    assert projection_shapes(model) == [(512, 2048)]
