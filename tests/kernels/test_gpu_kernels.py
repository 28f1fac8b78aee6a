"""GPU kernels (`kernels/triton_*.py`) against their reference on the same random inputs.

Runs on a CUDA device (skipped cleanly without one). For development without a GPU, the Triton
interpreter runs them on the CPU: `TRITON_INTERPRET=1 DSASERVE_TEST_TRITON_INTERPRET=1 pytest ...`; the
interpreter truncates where the GPU rounds, so bounds are doubled there.
Every test draws a fresh seed (printed in the failure message). Outputs the op allocates are poisoned
by filling the caching allocator's free memory with NaN first, so an element the kernel never wrote
shows up as NaN. Relative errors are ||got - ref|| / ||ref||; the bounds, and where they come from:
  BF16: 1e-2   bf16 operands / outputs (8-bit mantissa, 2^-9 rounding) with fp32 accumulation
  FP8A: 6e-2   activations quantised per (token, 128) to e4m3 (3-bit mantissa: ~2.6% RMS on
               Gaussian data) where the reference keeps them exact (prefill GEMMs, prefill MoE)
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from dsaserve.engine.kv_pool import decode_index_k, decode_latent, encode_index_k, encode_latent
from dsaserve.kernels import reference as R
from dsaserve.weights.fp8 import quantize_fp8_block

_INTERP = os.environ.get("DSASERVE_TEST_TRITON_INTERPRET") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
_HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not _HAS_TRITON or not (torch.cuda.is_available() or _INTERP),
                                reason="GPU kernels need CUDA + Triton (or the Triton interpreter)")
SLACK = 2.0 if DEVICE == "cpu" else 1.0
BF16 = 1e-2 * SLACK
FP8A = 6e-2 * SLACK
# KV encode vs kv_pool's: same bytes but for rare rounding ties (the interpreter truncates: no bound there)
ENC_REL, ENC_BYTES = (1e-2, 0.01) if DEVICE == "cuda" else (0.1, 0.5)
BIG = DEVICE == "cuda"


@pytest.fixture
def gen():
    seed = random.SystemRandom().randrange(1 << 31)
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return g


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _poison() -> None:
    """Fill freed allocator blocks (large and small pools) with NaN so unwritten outputs are visible."""
    if DEVICE != "cuda":
        return
    big = torch.full((64 << 20,), float("nan"), device=DEVICE)
    small = [torch.full((1 << 16,), float("nan"), device=DEVICE) for _ in range(64)]
    del big, small


def _randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def _ops():
    from dsaserve.kernels import triton_fp8_gemm, triton_indexer, triton_kv_write, triton_moe, triton_sparse_mla

    return triton_fp8_gemm, triton_indexer, triton_kv_write, triton_moe, triton_sparse_mla


# ---- FP8 linear ------------------------------------------------------------------------------------
GEMM_SHAPES = [(576, 6144), (2048, 1024), (300, 200)] if BIG else [(320, 256), (128, 200)]


@pytest.mark.parametrize("n,k", GEMM_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 64, 65, 300] if BIG else [1, 15, 70])
def test_fp8_linear_matches_reference(gen, m, n, k):
    gemm = _ops()[0]
    w, s = quantize_fp8_block(_randn(n, k, gen=gen))
    x = _randn(m, k, gen=gen, dtype=torch.bfloat16)
    _poison()
    got = gemm.fp8_linear(x, w, s)
    ref = R.fp8_linear(x, w, s)
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got).all()
    assert _rel(got, ref) < FP8A, f"seed {gen.initial_seed()}"  # every dispatched path quantises activations


VARIANTS = {  # every decode kernel variant the dispatcher may pick, on its own
    "fma": (dict(fma=True, block_m=1, block_n=64, num_warps=8, num_stages=3), BF16),
    "swap-bf16": (dict(fma=False, block_m=16, block_n=64, num_warps=4, num_stages=4), BF16),
    "swap-fp8": (dict(fma=False, a_fp8=True, block_m=16, block_n=64, num_warps=4, num_stages=4), FP8A),
    "swap-fp8-split": (dict(fma=False, a_fp8=True, block_m=16, block_n=128, num_warps=4, num_stages=4, split=3), FP8A),
}


@pytest.mark.parametrize("variant,m", [(v, m) for v in VARIANTS for m in ([1] if v == "fma" else [1, 5, 16])])
def test_fp8_skinny_variants_match_reference(gen, variant, m):
    gemm = _ops()[0]
    conf, bound = VARIANTS[variant]
    n, k = (640, 1152) if BIG else (320, 256)
    w, s = quantize_fp8_block(_randn(n, k, gen=gen))
    x = _randn(m, k, gen=gen, dtype=torch.bfloat16)
    _poison()
    got = gemm.skinny_gemm(x, w, s, out_dtype=torch.bfloat16, **{"split": 1, **conf})
    assert torch.isfinite(got).all() and _rel(got, R.fp8_linear(x, w, s)) < bound, f"seed {gen.initial_seed()}"


# ---- fused MoE -------------------------------------------------------------------------------------
def _moe_inputs(gen, t, e, h, inter, k, fp8=True):
    w13, w2 = _randn(e, 2 * inter, h, gen=gen, scale=0.05), _randn(e, h, inter, gen=gen, scale=0.05)
    s13 = s2 = None
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    x = _randn(t, h, gen=gen, dtype=torch.bfloat16)
    tw, ids = R.moe_route(_randn(t, e, gen=gen), torch.zeros(e, device=DEVICE), k, 1, 1, 2.5, True)
    return x, w13, s13, w2, s2, tw, ids


MOE = (16, 1024, 512, 8) if BIG else (8, 256, 128, 2)


@pytest.mark.parametrize("t", [1, 7, 64, 700] if BIG else [1, 9, 2100])
@pytest.mark.parametrize("fp8", [True, False])
def test_fused_moe_matches_reference(gen, t, fp8):
    moe = _ops()[3]
    e, h, inter, k = MOE
    args = _moe_inputs(gen, t, e, h, inter, k, fp8)
    _poison()
    got = moe.fused_moe(*args)
    ref = R.fused_moe(*args)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    bound = FP8A if fp8 else BF16  # FP8 experts quantise activations per (token, 128)
    assert _rel(got, ref) < bound, f"seed {gen.initial_seed()}"
    others = ({"kernel": "gemm"}, {"kernel": "swap", "block_m": 16}, {"kernel": "unsorted", "block_m": 16},
              {"fp8_act": False}, {"kernel": "swap", "fp8_act": False})
    for conf in others:  # every variant, whichever the dispatcher picked for this T
        other = moe.fused_moe(*args, config=conf)
        b = FP8A if fp8 and conf.get("fp8_act", True) else BF16
        assert _rel(other, ref) < b, f"seed {gen.initial_seed()} {conf}"


def test_moe_align_puts_every_pair_once_in_a_block_of_its_expert(gen):
    moe = _ops()[3]
    ids = torch.randint(0, 6, (37, 3), generator=gen, device=DEVICE)
    sorted_ids, bexp, total = moe.moe_align(ids, 6, 16)
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < flat.numel()].long()
    assert sorted(real.tolist()) == list(range(flat.numel()))
    blocks = torch.arange(sorted_ids.numel(), device=DEVICE) // 16
    live = sorted_ids < flat.numel()
    assert torch.equal(flat[sorted_ids[live].long()], bexp[blocks[live]].long())
    assert int(total) % 16 == 0 and int(total) >= flat.numel()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_fused_moe_replays_from_a_cuda_graph(gen):
    moe = _ops()[3]
    e, h, inter, k = MOE
    x, w13, s13, w2, s2, tw, ids = _moe_inputs(gen, 4, e, h, inter, k)
    moe.fused_moe(x, w13, s13, w2, s2, tw, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, s13, w2, s2, tw, ids)
    x2, *_, tw2, ids2 = _moe_inputs(gen, 4, e, h, inter, k)
    x.copy_(x2), tw.copy_(tw2), ids.copy_(ids2)
    graph.replay()
    assert _rel(out, R.fused_moe(x, w13, s13, w2, s2, tw, ids)) < FP8A, f"seed {gen.initial_seed()}"


# ---- indexer top-k ---------------------------------------------------------------------------------
def _indexer_case(gen, layout, seq_lens, ext, ps, hi, d):
    n_pages = sum(-(-s // ps) for s in seq_lens) + 3
    keys = _randn(n_pages * ps, d, gen=gen)
    cache = encode_index_k(keys, layout)
    max_pages = max(-(-s // ps) for s in seq_lens) + 1  # one spare page: the static bound exceeds the need
    perm = torch.randperm(n_pages, generator=gen, device=DEVICE)
    table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int64, device=DEVICE)
    used = 0
    for r, s in enumerate(seq_lens):
        n = -(-s // ps)
        table[r, :n] = perm[used:used + n]
        used += n
    pos = torch.tensor([p for s, e in zip(seq_lens, ext, strict=True) for p in range(s - e, s)], device=DEVICE)
    req = torch.tensor([r for r, e in enumerate(ext) for _ in range(e)], device=DEVICE)
    q = _randn(len(pos), hi, d, gen=gen, dtype=torch.bfloat16)
    w = torch.rand(len(pos), hi, generator=gen, device=DEVICE)
    return q, w, cache, table, req, pos


def _check_topk(got, q, w, cache, layout, table, req, pos, topk, ps, seed):
    keys = decode_index_k(cache, layout).double()
    for t in range(len(pos)):
        r, p = int(req[t]), int(pos[t])
        j = torch.arange(p + 1, device=DEVICE)
        slots = table[r, j // ps] * ps + j % ps
        scores = ((q[t].double() @ keys[slots].t()).relu() * w[t, :, None].double()).sum(0)
        row = got[t]
        sel = row[row >= 0]
        assert sel.numel() == min(topk, p + 1), f"seed {seed} token {t}"
        assert sel.unique().numel() == sel.numel(), f"seed {seed} token {t}: duplicate slots"
        pos_of = {int(s): i for i, s in enumerate(slots.tolist())}
        assert all(int(s) in pos_of for s in sel), f"seed {seed} token {t}: slot outside the causal keys"
        picked = scores[[pos_of[int(s)] for s in sel]]
        kth = scores.topk(sel.numel())[0][-1]
        # near-ties at the k-th score may go either way (fp32 accumulation order)
        assert picked.min() >= kth - 1e-4 * scores.abs().max(), f"seed {seed} token {t}"


@pytest.mark.parametrize("layout,topk", [("fp8_ds_mla", 256), ("bf16", 256), ("fp8_ds_mla", 2048)])
def test_indexer_topk_selects_the_reference_keys(gen, layout, topk):
    idx = _ops()[1]
    ps, hi, d = (64, 32, 128) if BIG else (16, 16, 32)
    topk = topk if BIG else topk // 10  # 2048 / 204: more than the page table holds -> every visible key
    seq_lens, ext = ([300, 1000, 77, 513], [1, 1, 77, 5]) if BIG else ([37, 5, 50], [3, 5, 1])
    q, w, cache, table, req, pos = _indexer_case(gen, layout, seq_lens, ext, ps, hi, d)
    _poison()
    got = idx.indexer_topk(q, w, cache, layout, table, req, pos, topk, ps, seq_lens, ext)
    assert got.shape == (len(pos), topk) and got.dtype == torch.int64
    _check_topk(got, q, w, cache, layout, table, req, pos, topk, ps, gen.initial_seed())
    ref = R.indexer_topk(q, w, cache, layout, table, req, pos, topk, ps, seq_lens, ext)
    same = sum(sorted(a.tolist()) == sorted(b.tolist()) for a, b in zip(got, ref, strict=True))
    assert same >= len(pos) - 1, f"seed {gen.initial_seed()}: {same}/{len(pos)} rows equal the reference's set"


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_indexer_topk_replays_from_a_cuda_graph(gen):
    idx = _ops()[1]
    ps, hi, d, topk = 64, 32, 128, 128
    seq_lens, ext = [700, 90, 300], [1, 1, 1]
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, ps, hi, d)
    idx.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = idx.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps)
    q.copy_(_randn(*q.shape, gen=gen, dtype=q.dtype))
    pos.copy_(torch.tensor([650, 40, 299], device=DEVICE))
    graph.replay()
    _check_topk(out, q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed())


# ---- sparse MLA ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16", "fp8_e4m3", "fp32"])
@pytest.mark.parametrize("t", [1, 5, 200] if BIG else [1, 3])
def test_sparse_mla_attention_matches_reference(gen, layout, t):
    mla = _ops()[4]
    h, dc, dr, k, n_slots = (64, 512, 64, 2048, 4096) if BIG else (4, 128, 16, 40, 200)
    latent = _randn(n_slots, dc + dr, gen=gen)
    cache = encode_latent(latent, layout, dc)
    slots = torch.randint(0, n_slots, (t, k), generator=gen, device=DEVICE)
    slots[0, k // 3: k // 2] = -1  # a partly filled selection (short context)
    qn, qr = _randn(t, h, dc, gen=gen, dtype=torch.bfloat16), _randn(t, h, dr, gen=gen, dtype=torch.bfloat16)
    _poison()
    got = mla.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc)
    ref = R.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc)
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got).all()
    assert _rel(got, ref) < BF16, f"seed {gen.initial_seed()}"
    unsplit = mla.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc, config={"splits": 1})
    assert _rel(unsplit, ref) < BF16, f"seed {gen.initial_seed()}"
    if layout == "fp8_ds_mla":  # the generic (dequantise-first) kernel as well as the 4-group one
        generic = mla.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc, config={"grouped": False})
        assert _rel(generic, ref) < BF16, f"seed {gen.initial_seed()}"


def test_sparse_mla_attention_gives_zeros_for_a_token_with_no_slots(gen):
    mla = _ops()[4]
    latent = _randn(50, 144, gen=gen)
    cache = encode_latent(latent, "fp8_ds_mla", 128)
    slots = torch.full((2, 32), -1, device=DEVICE)
    slots[1, :5] = torch.arange(5)
    qn, qr = _randn(2, 4, 128, gen=gen, dtype=torch.bfloat16), _randn(2, 4, 16, gen=gen, dtype=torch.bfloat16)
    got = mla.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.1, 128)
    assert got[0].eq(0).all()
    ref = R.sparse_mla_attention(qn[1:], qr[1:], cache, "fp8_ds_mla", slots[1:], 0.1, 128)
    assert _rel(got[1:], ref) < BF16


# ---- KV writes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16", "fp32", "fp8_e4m3"])
@pytest.mark.parametrize("dims", [(512, 64), (128, 16)])
def test_mla_kv_write_matches_reference_and_touches_only_its_slots(gen, layout, dims):
    kvw = _ops()[2]
    dc, dr = dims
    t, n_slots = (37, 128) if BIG else (5, 16)
    kv_a = _randn(t, dc + dr, gen=gen, dtype=torch.bfloat16)
    wt = (torch.rand(dc, generator=gen, device=DEVICE) + 0.5).bfloat16()
    ang = torch.rand(t, dr // 2, generator=gen, device=DEVICE) * 6
    slots = torch.randperm(n_slots, generator=gen, device=DEVICE)[:t]
    width = encode_latent(kv_a[:1].float(), layout, dc).shape[1]
    poison = torch.randint(0, 256, (n_slots, width), generator=gen, device=DEVICE, dtype=torch.uint8)
    ref_cache, got_cache = poison.clone(), poison.clone()
    ref = R.mla_kv_write(ref_cache, layout, slots, kv_a, wt, 1e-5, ang.cos(), ang.sin(), dc)
    got = kvw.mla_kv_write(got_cache, layout, slots, kv_a, wt, 1e-5, ang.cos(), ang.sin(), dc)
    assert got.dtype == ref.dtype and _rel(got, ref) < 5e-3 * SLACK, f"seed {gen.initial_seed()}"
    others = torch.ones(n_slots, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(got_cache[others], poison[others])
    dref, dgot = decode_latent(ref_cache[slots], layout, dc), decode_latent(got_cache[slots], layout, dc)
    assert torch.isfinite(dgot.float()).all()
    # identical bytes except an occasional one-ulp rounding tie (rsqrt / division order)
    assert _rel(dgot.float(), dref.float()) < ENC_REL, f"seed {gen.initial_seed()}"
    assert (got_cache[slots] != ref_cache[slots]).float().mean() < ENC_BYTES


def test_mla_kv_write_skips_negative_slots(gen):
    kvw = _ops()[2]
    kv_a = _randn(3, 144, gen=gen, dtype=torch.bfloat16)
    cache = torch.zeros(8, 164, dtype=torch.uint8, device=DEVICE)
    ang = torch.rand(3, 8, generator=gen, device=DEVICE)
    kvw.mla_kv_write(cache, "fp8_ds_mla", torch.tensor([2, -1, 5], device=DEVICE), kv_a,
                     torch.ones(128, dtype=torch.bfloat16, device=DEVICE), 1e-5, ang.cos(), ang.sin(), 128)
    assert cache[[0, 1, 3, 4, 6, 7]].eq(0).all() and cache[[2, 5]].ne(0).any(dim=1).all()


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16", "fp32"])
def test_indexer_k_write_matches_the_pool_encoding(gen, layout):
    kvw = _ops()[2]
    t, d, n_slots = 9, 128, 32
    k = _randn(t, d, gen=gen, dtype=torch.bfloat16)
    slots = torch.randperm(n_slots, generator=gen, device=DEVICE)[:t]
    width = encode_index_k(k[:1], layout).shape[1]
    poison = torch.randint(0, 256, (n_slots, width), generator=gen, device=DEVICE, dtype=torch.uint8)
    ref, got = poison.clone(), poison.clone()
    ref.index_copy_(0, slots, encode_index_k(k, layout))
    kvw.indexer_k_write(got, layout, slots, k)
    others = torch.ones(n_slots, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(got[others], poison[others])
    assert _rel(decode_index_k(got[slots], layout).float(), decode_index_k(ref[slots], layout).float()) < ENC_REL
    assert (got[slots] != ref[slots]).float().mean() < ENC_BYTES


@pytest.mark.skipif(DEVICE != "cuda", reason="the registry picks GPU kernels only on CUDA")
def test_registry_binds_gpu_kernels_on_cuda(monkeypatch):
    from dsaserve.kernels import registry

    ops = registry.get_ops("cuda")
    assert ops.impls["fused_moe"].startswith("triton") and ops.impls["sparse_mla_attention"].startswith("triton")
    assert ops.fp8_linear is _ops()[0].fp8_linear and ops.graph_safe
    monkeypatch.setenv(registry.FP8_ACT_ENV, "0")
    assert "bf16 activations" in registry.get_ops("cuda").impls["fp8_linear"]
    monkeypatch.setenv(registry.ENV_VAR, "reference")
    assert registry.get_ops("cuda").fp8_linear is R.fp8_linear


@pytest.mark.parametrize("m", [1, 40, 100])
def test_fp8_linear_exact_activations_match_reference_to_bf16(gen, m):
    gemm = _ops()[0]
    n, k = (640, 1152) if BIG else (320, 256)
    w, s = quantize_fp8_block(_randn(n, k, gen=gen))
    x = _randn(m, k, gen=gen, dtype=torch.bfloat16)
    _poison()
    got = gemm.fp8_linear(x, w, s, exact_act=True)
    assert torch.isfinite(got).all() and _rel(got, R.fp8_linear(x, w, s)) < BF16, f"seed {gen.initial_seed()}"


# ---- router, row-wise ops --------------------------------------------------------------------------
SMALL_ROWS = 32  # triton_fp8_gemm.SMALL_M: decode-size outputs carry an FP8 copy
BF16_ULP = dict(rtol=2 ** -6 * SLACK, atol=2 ** -6 * SLACK)  # one bf16 rounding apart (8-bit mantissa)


@pytest.mark.parametrize("t,e,k,groups,keep", [(1, 32, 8, 1, 1), (37, 256, 8, 8, 4), (5, 8, 2, 1, 1),
                                               (3, 64, 6, 8, 3), (2, 160, 8, 1, 1)])
def test_moe_route_matches_reference(gen, t, e, k, groups, keep):
    from dsaserve.kernels import triton_moe_route

    logits, bias = _randn(t, e, gen=gen, scale=2.0), _randn(e, gen=gen, scale=0.1)
    got_w, got_ids = triton_moe_route.moe_route(logits, bias, k, groups, keep, 2.5, True)
    ref_w, ref_ids = R.moe_route(logits, bias, k, groups, keep, 2.5, True)
    order_got, order_ref = got_ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order_got.values, order_ref.values), f"seed {gen.initial_seed()}"
    assert torch.allclose(got_w.gather(1, order_got.indices), ref_w.gather(1, order_ref.indices), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2048, 6144, 100])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_and_residual_add_match_reference(gen, n, dtype):
    from dsaserve.kernels import triton_elementwise as E

    x, r = _randn(7, n, gen=gen, dtype=dtype), _randn(7, n, gen=gen, dtype=dtype)
    w = _randn(n, gen=gen, dtype=dtype)
    tol = BF16_ULP if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(E.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6), **tol)
    y, s = E.add_rms_norm(x, r, w, 1e-6)
    ref_y, ref_s = R.add_rms_norm(x, r, w, 1e-6)
    if DEVICE == "cuda":  # the add rounds exactly as torch's (the interpreter truncates instead)
        assert torch.equal(s, ref_s)
    torch.testing.assert_close(s, ref_s, **tol)
    torch.testing.assert_close(y, ref_y, **tol)


def test_silu_and_mul_matches_reference(gen):
    from dsaserve.kernels import triton_elementwise as E

    x = _randn(5, 2 * 2500, gen=gen, dtype=torch.bfloat16)
    torch.testing.assert_close(E.silu_and_mul(x), R.silu_and_mul(x), **BF16_ULP)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads", [0, 3, 64])
def test_rope_inplace_matches_reference_on_a_view(gen, interleaved, heads):
    from dsaserve.kernels import triton_elementwise as E

    t = 6
    full = _randn(t, *([heads] if heads else []), 192 + 64, gen=gen, dtype=torch.bfloat16)
    ang = _randn(t, 32, gen=gen)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    want = full.clone()
    want[..., 192:] = R.apply_rope(full[..., 192:], cos, sin, interleaved)
    E.rope_inplace(full[..., 192:], cos, sin, interleaved)
    torch.testing.assert_close(full, want, **BF16_ULP)
    assert torch.equal(full[..., :192], want[..., :192])  # the rest of the row is untouched


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "silu_and_mul"])
def test_row_kernels_attach_the_fp8_copy_the_gemm_would_make(gen, op):
    from dsaserve.kernels import triton_elementwise as E
    from dsaserve.kernels import triton_fp8_gemm as G

    n = 2048
    x = _randn(3, n if op != "silu_and_mul" else 2 * n, gen=gen, dtype=torch.bfloat16)
    w = _randn(n, gen=gen, dtype=torch.bfloat16)
    y = {"rms_norm": lambda: E.rms_norm(x, w, 1e-6), "add_rms_norm": lambda: E.add_rms_norm(x, x, w, 1e-6)[0],
         "silu_and_mul": lambda: E.silu_and_mul(x)}[op]()
    q, s = G.cached_fp8(y)
    ref_q, ref_s = G.quant_act_fp8(y)
    torch.testing.assert_close(s, ref_s)
    assert (q.float() - ref_q.float()).abs().max() <= ref_q.float().abs().max() * 2 ** -3  # <= 1 e4m3 step
    big = _randn(SMALL_ROWS + 1, n, gen=gen, dtype=torch.bfloat16)
    assert G.cached_fp8(E.rms_norm(big, w, 1e-6)) is None  # prefill-size outputs carry none


def test_count_distinct_matches_reference(gen):
    from dsaserve.kernels import triton_moe_route as RT

    ids = torch.randint(0, 40, (37, 8), generator=gen, device=DEVICE)
    got = torch.zeros((), dtype=torch.int64, device=DEVICE)
    want = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for _ in range(2):
        RT.count_distinct(ids, 64, got)
        R.count_distinct(ids, 64, want)
    assert int(got) == int(want) == 2 * int(ids.unique().numel())


def test_fused_moe_takes_an_empty_batch(gen):
    moe = _ops()[3]
    e, h, inter, k = MOE
    x, w13, s13, w2, s2, tw, ids = _moe_inputs(gen, 1, e, h, inter, k)
    out = moe.fused_moe(x[:0], w13, s13, w2, s2, tw[:0], ids[:0])
    assert out.shape == (0, h)


def test_split_k_parts_sum_to_the_unsplit_result(gen):
    gemm = _ops()[0]
    n, k = (640, 2048) if BIG else (192, 1024)
    w, s = quantize_fp8_block(_randn(n, k, gen=gen))
    x = _randn(3, k, gen=gen, dtype=torch.bfloat16)
    conf = dict(fma=False, a_fp8=True, block_m=16, block_n=64, num_warps=4, num_stages=4)
    one = gemm.skinny_gemm(x, w, s, out_dtype=torch.float32, split=1, **conf)
    for split in (2, 4, 8):
        got = gemm.skinny_gemm(x, w, s, out_dtype=torch.float32, split=split, **conf)
        torch.testing.assert_close(got, one, rtol=1e-5, atol=1e-4)
    assert int(gemm.split_counters(x.device).abs().sum()) == 0  # every tile's counter reset for the next launch


@pytest.mark.parametrize("n_keys,k", [(3000, 2048), (600, 64), (40, 64)])
def test_topk_select_paths_pick_the_same_slots(gen, n_keys, k):
    """The in-register bisection (rows up to 16K keys) and the L2 one (longer rows) on the same scores."""
    idx = _ops()[1]
    width = 4096
    scores = _randn(2, width, gen=gen)
    scores[:, 5:40] = scores[:, 50:51]  # a run of ties around any threshold
    scores[:, n_keys:] = float("-inf")
    table = torch.arange(width // 64, device=DEVICE).repeat(2, 1)
    req, pos = torch.arange(2, device=DEVICE), torch.full((2,), n_keys - 1, device=DEVICE)
    outs = []
    for conf in ({"BLOCK": width, "ROW_IN_REGS": True}, {"BLOCK": 1024, "ROW_IN_REGS": False}):
        out = torch.full((2, k), -1, dtype=torch.int64, device=DEVICE)
        idx._topk_select_kernel[(2,)](scores, table, req, pos, out, width, k, 64, scores.stride(0), table.stride(0),
                                      out.stride(0), **conf)
        outs.append(out)
    want = min(k, n_keys)
    kth = scores[0, :n_keys].topk(want).values[-1]
    for out in outs:
        assert (out[:, :want] >= 0).all() and (out[:, want:] == -1).all()
        assert (scores[0, out[0, :want]] >= kth).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("t", [1, 3, 17, 40])
def test_head_bmm_matches_reference_and_attaches_the_fp8_copy(gen, t):
    """Absorbed-MLA per-head GEMMs: q_nope (a strided slice of q) @ W_uk -> [T, H, 512]; latent @ W_uv ->
    [T, H*256] flattened for o_proj, with the FP8 copy o_proj's GEMM would make (decode sizes)."""
    from dsaserve.kernels import triton_fp8_gemm as G
    from dsaserve.kernels import triton_head_gemm as HG

    _poison()
    h, nope, rope, dc, v = (16, 192, 64, 512, 256) if BIG else (4, 48, 16, 128, 128)
    q = _randn(t, h, nope + rope, gen=gen, dtype=torch.bfloat16)
    w_uk = _randn(h, nope, dc, gen=gen, dtype=torch.bfloat16, scale=nope ** -0.5)
    got = HG.head_bmm(q[..., :nope], w_uk)
    assert got.shape == (t, h, dc)
    assert _rel(got, R.head_bmm(q[..., :nope].float(), w_uk.float())) < BF16
    latent = _randn(t, h, dc, gen=gen, dtype=torch.bfloat16)
    w_uv = _randn(h, dc, v, gen=gen, dtype=torch.bfloat16, scale=dc ** -0.5)
    flat = HG.head_bmm(latent, w_uv, flatten=True)
    assert flat.shape == (t, h * v) and _rel(flat, R.head_bmm(latent.float(), w_uv.float(), flatten=True)) < BF16
    if t <= SMALL_ROWS:
        q8, s8 = G.cached_fp8(flat)
        ref_q, ref_s = G.quant_act_fp8(flat)
        torch.testing.assert_close(s8, ref_s)
        assert (q8.float() - ref_q.float()).abs().max() <= ref_q.float().abs().max() * 2 ** -3  # <= 1 e4m3 step
    else:
        assert G.cached_fp8(flat) is None


@pytest.mark.parametrize("t", [1, 5])
def test_fused_moe_adds_the_shared_output_in_its_combine(gen, t):
    """add= (the shared expert's output) is summed in the combine kernel exactly as a separate torch add."""
    moe = _ops()[3]
    e, h, inter, k = MOE
    x, w13, s13, w2, s2, tw, ids = _moe_inputs(gen, t, e, h, inter, k)
    shared = _randn(t, h, gen=gen, dtype=x.dtype)
    assert torch.equal(moe.fused_moe(x, w13, s13, w2, s2, tw, ids, add=shared),
                       moe.fused_moe(x, w13, s13, w2, s2, tw, ids) + shared)


@pytest.mark.parametrize("t", [1, 7, 40])
def test_router_logits_match_reference_in_fp32(gen, t):
    from dsaserve.kernels import triton_moe_route as RT

    e, h = (256, 6144) if BIG else (8, 256)
    x = _randn(t, h, gen=gen, dtype=torch.bfloat16)
    w = _randn(e, h, gen=gen, scale=h ** -0.5)
    got = RT.router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (t, e)
    torch.testing.assert_close(got, R.router_logits(x, w), rtol=1e-5, atol=1e-5)


def _position_ordered_topk(row: torch.Tensor, pos: int, k: int) -> torch.Tensor:
    """The positions the selection must return: every key above the k-th, then ties in position order."""
    vis = row[: pos + 1]
    kth = vis.topk(k).values[-1]
    above = (vis > kth).nonzero().squeeze(1)
    ties = (vis == kth).nonzero().squeeze(1)[: k - len(above)]
    return torch.sort(torch.cat([above, ties])).values


@pytest.mark.parametrize("kind", ["normal", "ties", "all_equal", "negative", "wide", "narrow", "relu_zeros"])
@pytest.mark.parametrize("width", [512, 8192] if BIG else [512])
def test_topk_select_in_registers_takes_the_kth_key_exactly(gen, kind, width):
    """The histogram search finds the exact k-th key on rows that stress it: runs of ties, one value
    everywhere, a range spanning many exponents, a range of a few ulps, zeros of both signs."""
    idx = _ops()[1]
    n, k = 4, (64 if width == 512 else 2048)
    s = _randn(n, width, gen=gen)
    s = {"ties": lambda: (s * 3).round(), "all_equal": lambda: torch.full_like(s, 1.5),
         "negative": lambda: -s.abs() - 10, "wide": lambda: s * torch.exp(_randn(n, width, gen=gen) * 20),
         "narrow": lambda: 1.0 + s * 1e-6, "relu_zeros": lambda: s.clamp(min=0) * torch.sign(_randn(n, width, gen=gen)),
         "normal": lambda: s}[kind]()
    pos = torch.randint(width // 2, width, (n,), generator=gen, device=DEVICE)
    for r in range(n):
        s[r, int(pos[r]) + 1:] = float("-inf")
    table = torch.arange(width // 64, device=DEVICE).repeat(n, 1)
    out = torch.full((n, k), -7, dtype=torch.int64, device=DEVICE)
    idx._topk_select_kernel[(n,)](s, table, torch.arange(n, device=DEVICE), pos, out, width, k, 64, s.stride(0),
                                  table.stride(0), out.stride(0), BLOCK=width, ROW_IN_REGS=True)
    for r in range(n):
        assert torch.equal(out[r], _position_ordered_topk(s[r], int(pos[r]), k)), f"seed {gen.initial_seed()} row {r}"
