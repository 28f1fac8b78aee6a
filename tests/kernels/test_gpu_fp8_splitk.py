"""The warp-specialised split-K FP8 GEMM (`gluon_fp8_splitk`) against the reference block-scaled linear, on a Hopper
GPU; its split choice on the CPU."""

import pytest
import torch

from dsaserve.kernels import gluon_common
from dsaserve.kernels import reference as R

gpu = pytest.mark.skipif(not torch.cuda.is_available() or not gluon_common.available(torch.device("cuda")),
                         reason="Gluon wgmma: a Hopper GPU")


def _case(m: int, n: int, k: int, seed: int):
    from dsaserve.kernels.triton_fp8_gemm import quant_act_fp8

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) * 0.5).to(torch.float8_e4m3fn)
    s = torch.rand(n // 128, k // 128, device="cuda", generator=gen) * 1e-2 + 1e-3
    a, a_s = quant_act_fp8(x, scale_m_major=True)
    exact = (a.float().view(m, k // 128, 128) * a_s[..., None]).view(m, k) @ R.dequant_fp8_weight(w, s).t()
    return x, w, s, a, a_s, exact


@gpu
@pytest.mark.parametrize("m", [1, 16, 33, 64, 100, 128])
@pytest.mark.parametrize("n,k,split", [(2816, 6144, 6), (6144, 16384, 2), (6144, 16384, 3), (640, 2048, 1),
                                       (4096, 6144, 5), (4096, 2048, 4), (640, 1024, 8)])  # the last two: splits
# shorter than the ring (4 and 1 blocks against STAGES 5); m 1 and 16 fill a 64-token tile with zero rows
def test_split_k_gemm_matches_the_reference(m, n, k, split):
    from dsaserve.kernels import gluon_fp8_splitk as SK

    x, w, s, a, a_s, exact = _case(m, n, k, m * 7 + split)
    got = SK.fp8_splitk_gemm(a, a_s, w, s, split=split)
    want = R.fp8_linear(x.float(), w, s)
    assert got.shape == (m, n) and float((got.float() - want).norm() / want.norm()) < 6e-2  # FP8 activations
    # the same quantised operands: fp32 sums, then one bf16 rounding (2^-9 relative at most, ~1e-3 as a norm)
    assert float((got.float() - exact).norm() / exact.norm()) < 3e-3


@gpu
def test_a_pdl_launch_reads_the_kernel_befores_output(monkeypatch):
    """Under PDL the producer asks for the first ring's weight tiles before it waits for the kernel before: the
    tokens it then reads are that kernel's output. Each GEMM right after the quantiser that writes its tokens, over
    inputs that change each time (eagerly; replayed from a graph with new values copied in before each replay):
    the bits of the launches without PDL, so no tile was read before the quantiser wrote it."""
    from dsaserve.kernels import gluon_fp8_splitk as SK
    from dsaserve.kernels.triton_fp8_gemm import quant_act_fp8
    from dsaserve.kernels.triton_utils import pdl_args

    if not pdl_args(torch.device("cuda"))["PDL"]:
        pytest.skip("PDL is off here (DSASERVE_PDL=0 or a GPU before Hopper)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    values = [[torch.randn(64, 16384, device="cuda", generator=gen).bfloat16() for _ in range(3)] for _ in range(2)]
    w, s = _case(64, 6144, 16384, 9)[1:3]
    xs = [v.clone() for v in values[0]]

    def chain():
        return [SK.fp8_splitk_gemm(*quant_act_fp8(x, scale_m_major=True), w, s, split=2) for x in xs]

    monkeypatch.setattr(SK, "PDL", False)
    want = []
    for r in range(2):
        for x, v in zip(xs, values[r], strict=True):
            x.copy_(v)
        want.append(chain())
    monkeypatch.setattr(SK, "PDL", True)
    chain()  # compiled before the checked launches, so none of them waits on a compile
    for got, ref in zip(chain(), want[1], strict=True):
        assert torch.equal(got, ref)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain()
    for r in (0, 1, 0, 1):
        for x, v in zip(xs, values[r], strict=True):
            x.copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        for got, ref in zip(outs, want[r], strict=True):
            assert torch.equal(got, ref)


@gpu
def test_split_k_is_deterministic_and_replays_from_a_graph():
    """The parts are added in split order whichever program ends last, and the counters reset themselves: 20
    launches and graph replays give the same bits, on both counter sets."""
    from dsaserve.kernels import gluon_fp8_splitk as SK

    _, w, s, a, a_s, _ = _case(128, 6144, 16384, 3)
    first = SK.fp8_splitk_gemm(a, a_s, w, s, split=4)
    for side in (False, True):
        for _ in range(20):
            assert torch.equal(SK.fp8_splitk_gemm(a, a_s, w, s, split=4, side_stream=side), first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = SK.fp8_splitk_gemm(a, a_s, w, s, split=4)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    assert not SK.counters(a.device).any()


@gpu
def test_bad_shapes_name_what_does_not_fit():
    from dsaserve.kernels import gluon_fp8_splitk as SK

    _, w, s, a, a_s, _ = _case(16, 640, 2048, 1)
    with pytest.raises(ValueError, match="split 17"):
        SK.fp8_splitk_gemm(a, a_s, w, s, split=17)  # 16 blocks of K cannot make 17 parts
    with pytest.raises(ValueError, match="16-byte aligned"):
        SK.fp8_splitk_gemm(a, a_s, w.t().contiguous().t(), s, split=1)  # column-major: no TMA tiles


@pytest.mark.parametrize("n,k,sms,want", [(6144, 16384, 132, 2), (2816, 6144, 132, 6), (16384, 2048, 132, 1),
                                          (4096, 6144, 132, 4), (6144, 2048, 132, 2), (6144, 12288, 132, 2),
                                          (640, 2048, 132, 4), (24576, 6144, 132, 1)])
def test_choose_split_fills_one_wave(n, k, sms, want):
    from dsaserve.kernels.gluon_fp8_splitk import choose_split

    assert choose_split(n, k, sms) == want


def test_tma_ok_wants_aligned_row_major_tiles():
    from dsaserve.kernels.gluon_fp8_splitk import tma_ok

    w = torch.zeros(256, 512, dtype=torch.uint8)
    assert tma_ok(w) and tma_ok(w[128:]) and tma_ok(w[:, 128:])
    assert not tma_ok(w.t()) and not tma_ok(w[:, 1:]) and not tma_ok(torch.zeros(4, 24, dtype=torch.uint8))


@gpu
@pytest.mark.parametrize("m", [33, 64, 128])
def test_fp8_linear_takes_it_where_it_splits(m, monkeypatch):
    """`fp8_linear` with SPLITK_GEMM: the split-K kernel at 33-64 rows where `choose_split` >= 2 (o_proj's shape),
    cuBLAS where it does not (q_b's) and at 128 rows; both within the FP8 activations' rounding of the reference."""
    from dsaserve.kernels import gluon_fp8_splitk as SK
    from dsaserve.kernels import triton_fp8_gemm as G

    calls = []
    real = SK.fp8_splitk_gemm
    monkeypatch.setattr(SK, "fp8_splitk_gemm", lambda *a, **kw: calls.append(a[4]) or real(*a, **kw))
    monkeypatch.setattr(G, "SPLITK_GEMM", True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, k in ((6144, 16384), (16384, 2048)):
        x, w, s = _case(m, n, k, m)[:3]
        calls.clear()
        got = G.fp8_linear(x, w, s)
        want = R.fp8_linear(x.float(), w, s)
        split = SK.choose_split(n, k, sms) if m <= G.SPLITK_ROWS[1] and k >= G.SPLITK_MIN_K else 1
        assert calls == ([split] if split > 1 else []) and got.dtype == x.dtype
        assert float((got.float() - want).norm() / want.norm()) < 6e-2
    monkeypatch.setattr(G, "SPLITK_GEMM", False)
    calls.clear()
    G.fp8_linear(*_case(m, 6144, 16384, 1)[:3])
    assert calls == []


@gpu
def test_the_side_stream_has_its_own_counters(monkeypatch):
    """Two long split GEMMs at once, one on the compute stream and one on a high-priority side stream (the shared
    expert's), ~100 programs each, so their tiles' arrivals interleave: each counted apart, both outputs the ones
    each gives alone, also replayed from a CUDA graph that forks the same way."""
    from dsaserve.kernels import triton_fp8_gemm as G

    monkeypatch.setattr(G, "SPLITK_GEMM", True)
    a = _case(64, 6144, 16384, 3)[:3]  # 48 tiles x split 2
    b = _case(48, 4096, 16384, 4)[:3]  # 32 tiles x split 4
    alone = (G.fp8_linear(*a), G.fp8_linear(*b))
    side = torch.cuda.Stream(priority=-1)
    assert side.priority < 0  # else this GPU has no stream priorities and the test shows nothing

    def both():
        side.wait_stream(torch.cuda.current_stream())
        out_a = G.fp8_linear(*a)  # launched first: b's programs land among its own
        with torch.cuda.stream(side):
            out_b = G.fp8_linear(*b)
        torch.cuda.current_stream().wait_stream(side)
        return out_a, out_b

    for _ in range(20):
        got = both()
        assert torch.equal(got[0], alone[0]) and torch.equal(got[1], alone[1])
    graph = torch.cuda.CUDAGraph()
    capture = torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture), torch.cuda.graph(graph, stream=capture):
        outs = both()
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(outs[0], alone[0]) and torch.equal(outs[1], alone[1])
    from dsaserve.kernels import gluon_fp8_splitk as SK

    assert not SK.counters(a[0].device).any()  # every (tile, half) of both streams reset by its last program
