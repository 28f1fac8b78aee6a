"""GPU GEMMs and MoE against their references: the FP8 block-scaled linear (skinny decode kernels,
split K, exact activations), the fused MoE (grouped GEMMs, combine), the router GEMV and the routing.
Set-up and error bounds: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels import reference as R
from dsaserve.weights.fp8 import quantize_fp8_block
from tests.kernels.gpu_common import (
    BF16,
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


# ---- FP8 linear ------------------------------------------------------------------------------------
# (640, 256) and (768, 384): N/128 odd and K/128 not a multiple of 4, where cuBLAS block scaling reads the
# weight scales at the wrong stride (scaled_mm_ok); glm-5.3-tiny's and -mini's merged q_a|kv_a|wk GEMMs
GEMM_SHAPES = ([(576, 6144), (2048, 1024), (300, 200), (640, 256), (768, 384)] if BIG
               else [(320, 256), (128, 200)])


@pytest.mark.parametrize("n,k", GEMM_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 15, 16, 17, 64, 65, 300] if BIG else [1, 15, 70])
def test_fp8_linear_matches_reference(gen, m, n, k):
    gemm = gpu_modules()[0]
    w, s = quantize_fp8_block(randn(n, k, gen=gen))
    x = randn(m, k, gen=gen, dtype=torch.bfloat16)
    poison_free_memory()
    got = gemm.fp8_linear(x, w, s)
    ref = R.fp8_linear(x, w, s)
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got).all()
    assert rel(got, ref) < FP8A, f"seed {gen.initial_seed()}"  # every dispatched path quantises activations


def projections(name: str) -> list[tuple[int, int]]:
    """(N, K) of the config's FP8 projections: q_a, q_b, kv_a, o_proj, the indexer's wq_b and wk, the dense MLP's
    gate+up and down, a shared expert's gate+up and down."""
    c = MODELS[name]
    h, heads = c.hidden_size, c.num_attention_heads
    shared = c.moe_intermediate_size * c.n_shared_experts
    return [(c.q_lora_rank, h), (heads * (c.qk_nope_head_dim + c.qk_rope_head_dim), c.q_lora_rank),
            (c.kv_lora_rank + c.qk_rope_head_dim, h), (h, heads * c.v_head_dim),
            (c.index_n_heads * c.index_head_dim, c.q_lora_rank), (c.index_head_dim, h),
            (2 * c.intermediate_size, h), (h, c.intermediate_size), (2 * shared, h), (h, shared)]


@pytest.mark.parametrize("model", MODELS)
def test_fp8_linear_takes_each_models_projections(gen, model):
    """Every projection shape of the config through the dispatcher, at decode (skinny) and prefill sizes."""
    gemm = gpu_modules()[0]
    for n, k in projections(model):
        w, s = quantize_fp8_block(randn(n, k, gen=gen))
        for m in (1, 40, 100):
            x = randn(m, k, gen=gen, dtype=torch.bfloat16)
            poison_free_memory()
            got = gemm.fp8_linear(x, w, s)
            assert torch.isfinite(got).all(), f"({n}, {k}) m={m}"
            assert rel(got, R.fp8_linear(x, w, s)) < FP8A, f"seed {gen.initial_seed()} ({n}, {k}) m={m}"


VARIANTS = {  # every decode kernel variant the dispatcher may pick, on its own
    "fma": (dict(fma=True, block_m=1, block_n=64, num_warps=8, num_stages=3), BF16),
    "swap-bf16": (dict(fma=False, block_m=16, block_n=64, num_warps=4, num_stages=4), BF16),
    "swap-fp8": (dict(fma=False, a_fp8=True, block_m=16, block_n=64, num_warps=4, num_stages=4), FP8A),
    "swap-fp8-split": (dict(fma=False, a_fp8=True, block_m=16, block_n=128, num_warps=4, num_stages=4, split=3), FP8A),
}


@pytest.mark.parametrize("variant,m", [(v, m) for v in VARIANTS for m in ([1] if v == "fma" else [1, 5, 16])])
def test_fp8_skinny_variants_match_reference(gen, variant, m):
    gemm = gpu_modules()[0]
    conf, bound = VARIANTS[variant]
    n, k = (640, 1152) if BIG else (320, 256)
    w, s = quantize_fp8_block(randn(n, k, gen=gen))
    x = randn(m, k, gen=gen, dtype=torch.bfloat16)
    poison_free_memory()
    got = gemm.skinny_gemm(x, w, s, out_dtype=torch.bfloat16, **{"split": 1, **conf})
    assert torch.isfinite(got).all() and rel(got, R.fp8_linear(x, w, s)) < bound, f"seed {gen.initial_seed()}"


# ---- fused MoE -------------------------------------------------------------------------------------
def _moe_inputs(gen, t, e, h, inter, k, fp8=True):
    w13, w2 = randn(e, 2 * inter, h, gen=gen, scale=0.05), randn(e, h, inter, gen=gen, scale=0.05)
    s13 = s2 = None
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    x = randn(t, h, gen=gen, dtype=torch.bfloat16)
    tw, ids = R.moe_route(randn(t, e, gen=gen), torch.zeros(e, device=DEVICE), k, 1, 1, 2.5, True)
    return x, w13, s13, w2, s2, tw, ids


MOE = (16, 1024, 512, 8) if BIG else (8, 256, 128, 2)


@pytest.mark.parametrize("t", [1, 7, 64, 700] if BIG else [1, 9, 2100])
@pytest.mark.parametrize("fp8", [True, False])
def test_fused_moe_matches_reference(gen, t, fp8):
    moe = gpu_modules()[3]
    e, h, inter, k = MOE
    args = _moe_inputs(gen, t, e, h, inter, k, fp8)
    poison_free_memory()
    got = moe.fused_moe(*args)
    ref = R.fused_moe(*args)
    assert got.shape == ref.shape and torch.isfinite(got).all()
    bound = FP8A if fp8 else BF16  # FP8 experts quantise activations per (token, 128)
    assert rel(got, ref) < bound, f"seed {gen.initial_seed()}"
    others = ({"kernel": "gemm"}, {"kernel": "swap", "block_m": 16}, {"kernel": "unsorted", "block_m": 16},
              {"fp8_act": False}, {"kernel": "swap", "fp8_act": False}) + ((moe.BUSY_CONFIG,) if fp8 else ())
    for conf in others:  # every variant, whichever the dispatcher picked for this T
        other = moe.fused_moe(*args, config=conf)
        b = FP8A if fp8 and conf.get("fp8_act", True) else BF16
        assert rel(other, ref) < b, f"seed {gen.initial_seed()} {conf}"
    swap = {"kernel": "swap", "block_m": 16}  # the grid's axes swapped: the same tiles, bit for bit
    assert torch.equal(moe.fused_moe(*args, config={**swap, "pairs_fastest": True}), moe.fused_moe(*args, config=swap))


@pytest.mark.parametrize("t", [1, 9, 300])
def test_fused_moe_float32_exact_path_is_not_rounded_to_bf16(gen, t):
    """A float32 model's MoE without FP8 activations (eval's GPU-in-float32 comparison), through each grouped-GEMM
    kernel: float32 activations between the GEMMs and float32 products, within summation order of the reference,
    far inside what rounding them to bf16 costs (they were, until 2026-12-05)."""
    moe = gpu_modules()[3]
    e, h, inter, k = MOE
    x, *rest = _moe_inputs(gen, t, e, h, inter, k, fp8=True)
    x = x.float() + randn(t, h, gen=gen, scale=1e-3)  # values off the bf16 grid
    ref = R.fused_moe(x, *rest)
    via_bf16 = rel(R.fused_moe(x.bfloat16().float(), *rest), ref)
    for conf in ({"fp8_act": False}, {"kernel": "swap", "fp8_act": False}, {"kernel": "gemm", "fp8_act": False},
                 {"kernel": "unsorted", "block_m": 16, "fp8_act": False}):
        got = moe.fused_moe(x, *rest, config=conf)
        assert got.dtype == torch.float32 and rel(got, ref) < 1e-5 < via_bf16 / 10, f"seed {gen.initial_seed()} {conf}"


@pytest.mark.parametrize("model", MODELS)
def test_fused_moe_takes_each_models_shapes(gen, model):
    """The config's hidden size, expert width and top-k (experts capped at 32: the kernels index them the same
    way), through each grouped-GEMM kernel."""
    cfg, moe = MODELS[model], gpu_modules()[3]
    e, h, inter, k = min(cfg.n_routed_experts, 32), cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    args = _moe_inputs(gen, 9, e, h, inter, k)
    ref = R.fused_moe(*args)
    poison_free_memory()
    for conf in (None, {"kernel": "gemm"}, {"kernel": "swap", "block_m": 16}, {"kernel": "unsorted", "block_m": 16},
                 {"fp8_act": False}):
        got = moe.fused_moe(*args, config=conf)
        bound = FP8A if (conf or {}).get("fp8_act", True) else BF16
        assert torch.isfinite(got).all() and rel(got, ref) < bound, f"seed {gen.initial_seed()} {conf}"


@pytest.mark.parametrize("t", [1, 9, 64])
def test_fused_moe_with_one_slot_per_row_matches_reference(gen, t):
    """DP-attention's exchange hands the experts one (expert, weight) per received row: top-k = 1."""
    moe = gpu_modules()[3]
    e, h, inter, _ = MOE
    args = _moe_inputs(gen, t, e, h, inter, 1)
    got, ref = moe.fused_moe(*args), R.fused_moe(*args)
    assert torch.isfinite(got).all() and rel(got, ref) < FP8A, f"seed {gen.initial_seed()}"


def test_moe_align_puts_every_pair_once_in_a_block_of_its_expert(gen):
    moe = gpu_modules()[3]
    ids = torch.randint(0, 6, (37, 3), generator=gen, device=DEVICE)
    sorted_ids, bexp, total = moe.moe_align(ids, 6, 16)
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < flat.numel()].long()
    assert sorted(real.tolist()) == list(range(flat.numel()))
    blocks = torch.arange(sorted_ids.numel(), device=DEVICE) // 16
    live = sorted_ids < flat.numel()
    assert torch.equal(flat[sorted_ids[live].long()], bexp[blocks[live]].long())
    assert int(total) % 16 == 0 and int(total) >= flat.numel()


@pytest.mark.parametrize("t", [1, 9, 64, 700] if BIG else [1, 9, 300])
def test_fused_moe_skips_absent_experts_pairs(gen, t):
    """EP: pairs of another rank's experts carry id E (`local_routes`) and must add exactly nothing, in every
    kernel (unsorted, swap, gemm); `moe_align` puts them past its total and `count_distinct` ignores them."""
    moe = gpu_modules()[3]
    from dsaserve.kernels import triton_moe_route as RT

    e, h, inter, k = MOE
    x, w13, s13, w2, s2, tw, ids = _moe_inputs(gen, t, e, h, inter, k)
    ids = torch.where(ids % 2 == 0, ids, e)  # odd experts live elsewhere
    poison_free_memory()
    ref = R.fused_moe(x, w13, s13, w2, s2, tw, ids, absent=True)
    for conf in ({}, {"kernel": "gemm"}, {"kernel": "swap", "block_m": 16}, {"kernel": "unsorted", "block_m": 16}):
        got = moe.fused_moe(x, w13, s13, w2, s2, tw, ids, config=conf, absent=True)
        assert torch.isfinite(got).all() and rel(got, ref) < FP8A, f"seed {gen.initial_seed()} {conf}"
    sorted_ids, bexp, total = moe.moe_align(ids, e, 16)
    live = sorted_ids[: int(total)]
    flat = ids.reshape(-1)
    assert sorted(live[live < flat.numel()].tolist()) == (flat < e).nonzero().flatten().tolist()
    got_n, want_n = (torch.zeros((), dtype=torch.int64, device=DEVICE) for _ in range(2))
    RT.count_distinct(ids, e, got_n)
    R.count_distinct(ids, e, want_n)
    assert int(got_n) == int(want_n) == int(flat[flat < e].unique().numel())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_fused_moe_replays_from_a_cuda_graph(gen):
    moe = gpu_modules()[3]
    e, h, inter, k = MOE
    x, w13, s13, w2, s2, tw, ids = _moe_inputs(gen, 4, e, h, inter, k)
    moe.fused_moe(x, w13, s13, w2, s2, tw, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, s13, w2, s2, tw, ids)
    x2, *_, tw2, ids2 = _moe_inputs(gen, 4, e, h, inter, k)
    x.copy_(x2), tw.copy_(tw2), ids.copy_(ids2)
    graph.replay()
    assert rel(out, R.fused_moe(x, w13, s13, w2, s2, tw, ids)) < FP8A, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 40, 100])
def test_fp8_linear_exact_activations_match_reference(gen, m, dtype):
    """bf16 activations: the reference's numbers to bf16 rounding. float32 ones (a float32 model: `dsaserve eval`'s
    GPU-in-float32 comparison) multiply in float32: within summation order, far inside what rounding x to bf16
    costs (they were rounded until 2026-12-05: on glm-5.3-mini that alone parts 4 of 10 greedy continuations from
    the CPU reference's)."""
    gemm = gpu_modules()[0]
    n, k = (640, 1152) if BIG else (320, 256)
    w, s = quantize_fp8_block(randn(n, k, gen=gen))
    x = randn(m, k, gen=gen, dtype=dtype)
    poison_free_memory()
    got = gemm.fp8_linear(x, w, s, exact_act=True)
    ref = R.fp8_linear(x, w, s)
    assert got.dtype == dtype and torch.isfinite(got).all(), f"seed {gen.initial_seed()}"
    if dtype == torch.bfloat16:
        assert rel(got, ref) < BF16, f"seed {gen.initial_seed()}"
    else:
        via_bf16 = rel(R.fp8_linear(x.bfloat16().float(), w, s), ref)
        assert rel(got, ref) < 1e-5 < via_bf16 / 10, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("tokens", [37, 1100])  # one program; one program per 256 ids (past 4096 ids)
def test_count_distinct_matches_reference(gen, tokens):
    from dsaserve.kernels import triton_moe_route as RT

    ids = torch.randint(0, 40, (tokens, 8), generator=gen, device=DEVICE)
    ids[-1, 0] = 64  # an absent expert's id: not counted
    got = torch.zeros((), dtype=torch.int64, device=DEVICE)
    want = torch.zeros((), dtype=torch.int64, device=DEVICE)
    for _ in range(2):
        RT.count_distinct(ids, 64, got)
        R.count_distinct(ids, 64, want)
    assert int(got) == int(want) == 2 * int(ids[ids < 64].unique().numel())


def test_fused_moe_takes_an_empty_batch(gen):
    moe = gpu_modules()[3]
    e, h, inter, k = MOE
    x, w13, s13, w2, s2, tw, ids = _moe_inputs(gen, 1, e, h, inter, k)
    out = moe.fused_moe(x[:0], w13, s13, w2, s2, tw[:0], ids[:0])
    assert out.shape == (0, h)


@pytest.mark.parametrize("exact", [False, True])
def test_fp8_linear_takes_zero_rows(gen, exact):
    """An EP rank's empty token chunk (K = 6144: 48 K blocks, where the split-K choice divided by 0 tiles)."""
    gemm = gpu_modules()[0]
    w, s = quantize_fp8_block(randn(256, 6144, gen=gen))
    out = gemm.fp8_linear(randn(0, 6144, gen=gen, dtype=torch.bfloat16), w, s, exact_act=exact)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16
    assert gemm.skinny_config(0, 256, 6144, 132)["split"] == 1


def test_split_k_parts_sum_to_the_unsplit_result(gen, monkeypatch):
    """Every split's part summed once, in split order, whether the last program loads four parts at once
    (`SPLIT_PARTS_AT_ONCE`: splits of 2 / 3 / 5 / 8 leave 4-groups part-full) or one at a time: the same bits."""
    gemm = gpu_modules()[0]
    n, k = (640, 2560) if BIG else (192, 1280)
    w, s = quantize_fp8_block(randn(n, k, gen=gen))
    x = randn(3, k, gen=gen, dtype=torch.bfloat16)
    conf = dict(fma=False, a_fp8=True, block_m=16, block_n=64, num_warps=4, num_stages=4)
    one = gemm.skinny_gemm(x, w, s, out_dtype=torch.float32, split=1, **conf)
    for split in (2, 5, 10):
        got = {}
        for at_once in (True, False):
            monkeypatch.setattr(gemm, "SPLIT_PARTS_AT_ONCE", at_once)
            got[at_once] = gemm.skinny_gemm(x, w, s, out_dtype=torch.float32, split=split, **conf)
        torch.testing.assert_close(got[True], one, rtol=1e-5, atol=1e-4)
        assert torch.equal(got[True], got[False]), split
    assert int(gemm.split_counters(x.device).abs().sum()) == 0  # every tile's counter reset for the next launch


@pytest.mark.parametrize("t", [1, 5])
def test_fused_moe_adds_the_shared_output_in_its_combine(gen, t):
    """add= (the shared expert's output) is summed in the combine kernel exactly as a separate torch add."""
    moe = gpu_modules()[3]
    e, h, inter, k = MOE
    x, w13, s13, w2, s2, tw, ids = _moe_inputs(gen, t, e, h, inter, k)
    shared = randn(t, h, gen=gen, dtype=x.dtype)
    assert torch.equal(moe.fused_moe(x, w13, s13, w2, s2, tw, ids, add=shared),
                       moe.fused_moe(x, w13, s13, w2, s2, tw, ids) + shared)


@pytest.mark.parametrize("t", [1, 5, 32, 40])
def test_fused_moe_runs_the_shared_expert_as_one_more_expert(gen, t):
    """shared= at decode sizes (the unsorted kernel, up to 32 tokens of top-8): the shared expert is one more
    expert of both GEMMs and its row joins the combine's fp32 sum; larger batches run it apart (`shared.run`,
    here the DenseMLP GPU path's kernels) and add it. Both against the reference, and fused against apart (one
    rounding of the shared output fewer: within the FP8 activations' bound, not equal)."""
    from dsaserve.kernels import triton_elementwise as EW
    from dsaserve.kernels import triton_fp8_gemm as G
    from dsaserve.kernels.reference import SharedExpert

    moe = gpu_modules()[3]
    e, h, inter, k = MOE
    x, w13, s13, w2, s2, tw, ids = _moe_inputs(gen, t, e, h, inter, k)
    (g13, t13), (g2, t2) = quantize_fp8_block(randn(2 * inter, h, gen=gen, scale=0.05)), \
        quantize_fp8_block(randn(h, inter, gen=gen, scale=0.05))
    shared = SharedExpert(g13, t13, g2, t2, lambda v: G.fp8_linear(EW.silu_and_mul(G.fp8_linear(v, g13, t13)), g2, t2))
    ref = R.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared)
    poison_free_memory()
    apart = moe.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared, config={"fuse_shared": False})
    fused = t * k <= moe.UNSORTED_MAX_PAIRS
    if fused:  # the fused route must be the one taken: running the shared expert apart now fails
        shared = shared._replace(run=lambda v: pytest.fail("the shared expert ran apart"))
    got = moe.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared)
    assert torch.isfinite(got).all() and rel(got, ref) < FP8A and rel(apart, ref) < FP8A, f"seed {gen.initial_seed()}"
    assert rel(got, apart) < FP8A
    if not fused:  # the same kernels as the apart path
        assert torch.equal(got, apart)
    with pytest.raises(ValueError, match="not both"):
        moe.fused_moe(x, w13, s13, w2, s2, tw, ids, add=x, shared=shared)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams: a CUDA device")
@pytest.mark.parametrize("capture", [False, True])
def test_fused_moe_runs_an_unfused_shared_expert_on_the_side_stream(gen, capture):
    """Past the unsorted kernel's sizes the shared expert runs apart (`shared.run`); given a side stream it runs
    there, joined before the combine: bit for bit the in-line result, eagerly and replayed from a CUDA graph."""
    from dsaserve.kernels import triton_elementwise as EW
    from dsaserve.kernels import triton_fp8_gemm as G
    from dsaserve.kernels.reference import SharedExpert

    moe = gpu_modules()[3]
    e, h, inter, k = MOE
    t = moe.UNSORTED_MAX_PAIRS // k + 24  # past the fused sizes
    x, w13, s13, w2, s2, tw, ids = _moe_inputs(gen, t, e, h, inter, k)
    (g13, t13), (g2, t2) = quantize_fp8_block(randn(2 * inter, h, gen=gen, scale=0.05)), \
        quantize_fp8_block(randn(h, inter, gen=gen, scale=0.05))
    ran = []
    shared = SharedExpert(g13, t13, g2, t2, lambda v: ran.append(torch.cuda.current_stream()) or G.fp8_linear(
        EW.silu_and_mul(G.fp8_linear(v, g13, t13)), g2, t2))
    side = torch.cuda.Stream()
    inline = moe.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared)
    if not capture:
        got = moe.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared, side_stream=side)
    else:
        graph, warm = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        warm.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warm):
            moe.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared, side_stream=side)
        torch.cuda.current_stream().wait_stream(warm)
        with torch.cuda.graph(graph):
            out = moe.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared, side_stream=side)
        graph.replay()
        got = out.clone()
    torch.cuda.synchronize()
    assert ran[-1] == side, "the shared expert did not run on the side stream"
    assert torch.equal(got, inline), f"seed {gen.initial_seed()}"
    off = moe.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared, side_stream=side, config={"shared_beside": False})
    assert ran[-1] != side and torch.equal(off, inline)
    moe.fused_moe(x, w13, s13, w2, s2, tw, ids, shared=shared, side_stream=side, config={"kernel": "dense"})
    assert ran[-1] != side, "the dense path's own combine does not wait for the side stream: in line"


ROUTES = sorted({(1, 32, 8, 1, 1), (37, 256, 8, 8, 4), (5, 8, 2, 1, 1), (3, 64, 6, 8, 3), (2, 160, 8, 1, 1)}
                | {(7, c.n_routed_experts, c.num_experts_per_tok, c.n_group, c.topk_group) for c in MODELS.values()})


@pytest.mark.parametrize("t,e,k,groups,keep", ROUTES)
def test_moe_route_matches_reference(gen, t, e, k, groups, keep):
    from dsaserve.kernels import triton_moe_route

    logits, bias = randn(t, e, gen=gen, scale=2.0), randn(e, gen=gen, scale=0.1)
    got_w, got_ids = triton_moe_route.moe_route(logits, bias, k, groups, keep, 2.5, True)
    ref_w, ref_ids = R.moe_route(logits, bias, k, groups, keep, 2.5, True)
    order_got, order_ref = got_ids.sort(-1), ref_ids.sort(-1)
    assert torch.equal(order_got.values, order_ref.values), f"seed {gen.initial_seed()}"
    assert torch.allclose(got_w.gather(1, order_got.indices), ref_w.gather(1, order_ref.indices), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bf16_valued", [False, True])
@pytest.mark.parametrize("t", [1, 7, 40, 128, 256])
@pytest.mark.parametrize("model", MODELS)
def test_router_logits_match_reference_in_fp32(gen, model, t, bf16_valued):
    """fp32 sums of x @ w^T. From 33 tokens a weight of bf16 values (the router's, widened from the checkpoint)
    takes the tiled kernel on tensor cores (exact products), any other fp32 weight cuBLAS."""
    from dsaserve.kernels import triton_moe_route as RT

    e, h = MODELS[model].n_routed_experts, MODELS[model].hidden_size
    x = randn(t, h, gen=gen, dtype=torch.bfloat16)
    w = randn(e, h, gen=gen, scale=h ** -0.5)
    if bf16_valued:
        w = w.bfloat16().float()
    got = RT.router_logits(x, w)
    assert got.dtype == torch.float32 and got.shape == (t, e)
    torch.testing.assert_close(got, R.router_logits(x, w), rtol=1e-5, atol=1e-5)
    tiled = RT._tile_gemm(x, w, torch.float32)
    assert (tiled is not None) == (bf16_valued and RT.ROUTER_GEMV_MAX_T < t <= RT.TILE_GEMM_MAX_T)


@pytest.mark.parametrize("t,e,h", [(128, 32, 6144), (256, 256, 6144), (33, 256, 7168), (200, 64, 7168)])
def test_router_and_weights_proj_tiles_at_the_served_configs_shapes(gen, t, e, h):
    """The split-K tiles at the slice's (32 experts), GLM-5.3's (256) and DeepSeek-V3.2's (hidden 7168) router
    shapes and an indexer's 64 heads: expert blocks of 32 and 64 rows, which the tiny configs (8 experts) do not
    reach. fp32 sums of exact bf16 products (the router); one bf16 rounding of them (weights_proj)."""
    from dsaserve.kernels import triton_moe_route as RT

    x = randn(t, h, gen=gen, dtype=torch.bfloat16)
    w = randn(e, h, gen=gen, scale=h ** -0.5).bfloat16()
    tiled = RT._tile_gemm(x, w.float(), torch.float32)
    assert tiled is not None
    torch.testing.assert_close(tiled, R.router_logits(x, w.float()), rtol=1e-5, atol=1e-5)
    got = RT.small_linear(x, w)
    torch.testing.assert_close(got.float(), x.float() @ w.float().t(), rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("t", [1, 7, 40, 128, 300])
@pytest.mark.parametrize("model", MODELS)
def test_small_linear_is_the_bf16_projection(gen, model, t):
    """The indexer's weights_proj (bf16 [Hi, H]) as one GEMV at decode sizes: fp32 sums rounded once to bf16, so
    within one bf16 rounding of the fp32 product; 33-256 rows a tiled split-K kernel's; past them cuBLAS's, the
    reference's own call, which torch lets reduce in bf16 (`allow_bf16_reduced_precision_reduction`: split-K
    partials rounded), so not within one rounding (H200, glm-5.3 at 300 rows: 1.2e-6 off a 4e-5 output, ~5 bf16
    steps; bench/RESULTS.md twenty-eighth session)."""
    from dsaserve.kernels import triton_moe_route as RT

    hi, h = MODELS[model].index_n_heads, MODELS[model].hidden_size
    x = randn(t, h, gen=gen, dtype=torch.bfloat16)
    w = randn(hi, h, gen=gen, dtype=torch.bfloat16, scale=h ** -0.5)
    got = RT.small_linear(x, w)
    exact = x.float() @ w.float().t()
    assert got.dtype == torch.bfloat16 and got.shape == (t, hi)
    if t > RT.TILE_GEMM_MAX_T:
        assert torch.equal(got, R.small_linear(x, w))
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -8, atol=1e-6)
        assert t <= RT.ROUTER_GEMV_MAX_T or RT._tile_gemm(x, w, x.dtype) is not None


@pytest.mark.parametrize("t", [1, 7, 32])
def test_route_weights_read_before_the_wait_change_no_bit(gen, t, monkeypatch):
    """`triton_moe_route.WEIGHTS_FIRST` moves the router GEMV's weight rows and moe_route's bias ahead of the PDL
    wait (the compiled order: tests/kernels/test_weights_before_pdl_wait.py): the same loads, so the same bits."""
    from dsaserve.kernels import triton_moe_route as RT

    x = randn(t, 6144, gen=gen, dtype=torch.bfloat16)
    w, bias = randn(32, 6144, gen=gen, scale=6144 ** -0.5), randn(32, gen=gen, scale=0.1)
    outs = {}
    for first in (False, True):
        monkeypatch.setattr(RT, "WEIGHTS_FIRST", first)
        logits = RT.router_logits(x, w)
        outs[first] = (logits, *RT.moe_route(logits, bias, 8, 1, 1, 2.5, True), RT.small_linear(x, w.bfloat16()))
    assert all(torch.equal(a, b) for a, b in zip(outs[False], outs[True], strict=True))
    torch.testing.assert_close(outs[True][0], R.router_logits(x, w), rtol=1e-5, atol=1e-5)
