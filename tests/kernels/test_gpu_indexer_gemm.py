"""The prefill indexer's tiled score GEMM + chunked radix select (`kernels/triton_indexer_gemm.py`) against the
reference and the kernel's own scores. Set-up and error bounds: tests/kernels/gpu_common.py; helpers shared with
the streaming prefill kernel's tests (test_gpu_indexer_topk.py). Small shapes run under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import get_kv_layout
from tests.kernels.gpu_common import (
    BIG,
    DEVICE,
    assert_within_q_rounding,
    index_keys,
    kernel_q,
    poison_free_memory,
    randn,
    requires_gpu_kernels,
)
from tests.kernels.test_gpu_attention import _check_topk, _indexer_case
from tests.kernels.test_gpu_indexer_topk import PREFILL_SHAPES, _assert_position_order, _prefill_inputs

pytestmark = requires_gpu_kernels

# small tiles, few tiles a program, a workspace of a few tokens: several programs a row, several chunks
SMALL = {"bt": 2, "bs": 32, "tpp": 2, "num_warps": 4, "num_stages": 2, "ws_budget": 16 * 4 * 544}


def _conf(select: str) -> dict | None:
    """select "radix+window": the radix select with its window pass before round 0."""
    how = {"select": select.split("+")[0], "window": select.endswith("+window")}
    return how if BIG else {**SMALL, **how}


@pytest.mark.parametrize("select", ["radix", "rows", "radix+window"])
@pytest.mark.parametrize("hi,d,topk", PREFILL_SHAPES)
def test_gemm_topk_selects_the_top_keys_of_its_scores(gen, hi, d, topk, select):
    """FP8 q: the exact top-k of the scores the kernel computes (q rounded to e4m3, checked in float64), the
    reference's selection up to near-ties that rounding q parts, in position order and -1 padded."""
    from dsaserve.kernels import reference as R
    from dsaserve.kernels.triton_indexer_gemm import gemm_topk

    q, w, cache, table, req, pos, ps, seq_lens, ext, _ = _prefill_inputs(gen, hi, d, topk)
    poison_free_memory()
    got = gemm_topk(q, w, cache, get_kv_layout("fp8_ds_mla"), table, req, pos, topk, ps, seq_lens, ext, q_fp8=True,
                    config=_conf(select))
    assert got.shape == (len(pos), topk) and got.dtype == torch.int64
    q8 = kernel_q(q, True, reciprocal=True)  # prepare_q's rule
    # the FP8 tensor-core dot accumulates with ~13 bits on Hopper (DeepGEMM's finding): on the H200 a picked key
    # scored 1.07e-4 of the row's max below the k-th in float64 (2026-12-01), a near-tie, not a wrong select
    _check_topk(got, q8, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed(), tol=2.0 ** -12)
    ref = R.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, seq_lens, ext)
    assert_within_q_rounding(got, ref, q, q8, w, cache, table, req, pos, ps, gen.initial_seed())
    _assert_position_order(got, table, req, pos, seq_lens, ps, gen.initial_seed())


def test_gemm_topk_fp16_q_and_causal_edges(gen):
    """q / s in fp16; requests whose tokens straddle topk (positions topk - 2 .. topk + 1), one shorter than
    topk (every key, -1 padded), ragged lengths, a request with no new token: the exact top-k of the kernel's
    scores. Equal to the streaming kernel's output up to near-ties."""
    from dsaserve.kernels.triton_indexer_gemm import gemm_topk

    ps, hi, d, topk = 16, 16, 32, 40
    seq_lens, ext = [42, 30, 77, 200, 64], [4, 30, 9, 0, 33]
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, ps, hi, d)
    w -= 0.3
    got = gemm_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, seq_lens, ext, q_fp8=False, config=SMALL)
    _check_topk(got, kernel_q(q, False, reciprocal=True), w, cache, "fp8_ds_mla", table, req, pos, topk, ps,
                gen.initial_seed())
    _assert_position_order(got, table, req, pos, seq_lens, ps, gen.initial_seed())
    short = req == 1
    assert (got[short][:, pos[short].max() + 1:] == -1).all()


def test_chunk_scores_are_the_float64_scores_of_the_rounded_q(gen):
    """The score GEMM alone: every written (token, key <= position) entry is sum_h w relu(q8 . k) * scale in
    float64 to fp32 accumulation error; tokens that see at most skip_below keys are not written."""
    from dsaserve.kernels import triton_indexer_gemm as G

    ps, hi, d, skip = 16, 32, 128, 20
    seq_lens, ext = [70, 45], [9, 30]
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, ps, hi, d)
    w -= 0.3
    conf = {**G.DEFAULT_CONFIG, **SMALL, "bt": 4}
    ops = (*G.prepare_q(q, w, True), *G.gather_keys(cache, table, seq_lens, ext, ps, d))
    ws = torch.full((len(pos), 96), float("nan"), device=DEVICE)
    G.chunk_scores(ops, req, pos, seq_lens, ext, 0, len(pos), ws, skip, conf)
    keys = index_keys(cache, "fp8_ds_mla", q.shape[-1]).double()
    q8 = kernel_q(q, True, reciprocal=True)  # prepare_q's rule
    for t in range(len(pos)):
        r, p = int(req[t]), int(pos[t])
        j = torch.arange(p + 1, device=DEVICE)
        want = ((q8[t] @ keys[table[r, j // ps] * ps + j % ps].t()).relu() * w[t, :, None].double()).sum(0)
        first = int((req == r).nonzero()[0])  # blocks of 4 tokens start at each request's first token
        block_last = max(int(pos[u]) for u in range(len(pos)) if req[u] == r and (u - first) // 4 == (t - first) // 4)
        if block_last < skip:  # the whole block is skipped
            assert ws[t].isnan().all(), t
            continue
        err = (ws[t, :p + 1].double() - want).abs().max()
        assert err <= 1e-5 * want.abs().max() + 1e-9, (t, float(err))


def _torch_prepare_q(q, w, fp8):
    """The torch formula `prepare_q`'s kernel replaced (its rounding is the reference): s = amax / 448 per (token,
    head), q / s clamped and cast, w * s, heads zero-padded to a power of two."""
    t, h, d = q.shape
    hp = 1 << (h - 1).bit_length()
    x = q.float()
    s = x.abs().amax(-1).clamp(min=1e-12) * (1.0 / 448.0)  # what `/ 448.0` computes on a GPU, on any device
    qo = torch.zeros((t, hp, d), dtype=torch.float8_e4m3fn if fp8 else torch.float16, device=q.device)
    qo[:, :h] = (x / s[..., None]).clamp(-448.0, 448.0).to(qo.dtype)
    wo = torch.zeros((t, hp), dtype=torch.float32, device=q.device)
    wo[:, :h] = w.float() * s
    return qo.view(torch.uint8 if fp8 else torch.int16), wo


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("heads", [32, 20])
def test_prepare_q_rounds_as_the_torch_formula_bit_for_bit(gen, fp8, heads):
    """One kernel for the scaling and the cast: the same bytes and weights as torch's formula, heads padded with
    zeros, a strided q (the heads of a wider projection), a token of zeros (s at its 1e-12 floor)."""
    from dsaserve.kernels.triton_indexer_gemm import prepare_q

    wide = randn(9, heads, 160, gen=gen, dtype=torch.bfloat16, scale=3.0)
    q = wide[..., :128]
    q[4] = 0
    w = randn(9, heads, gen=gen, dtype=torch.bfloat16)
    got_q, got_w = prepare_q(q, w, fp8)
    want_q, want_w = _torch_prepare_q(q, w, fp8)
    assert torch.equal(got_q, want_q) and torch.equal(got_w, want_w)


@pytest.mark.parametrize("select", ["radix", "rows"])
@pytest.mark.parametrize("garbage", [1e30, float("nan")])
def test_select_reads_no_workspace_column_past_the_position(gen, select, garbage):
    """The score workspace is never written past a token's position (stale scores of earlier chunks, or
    whatever the allocator held): both selections must ignore those columns. Rows wider than ROW_IN_REGS_MAX
    send the one-program select over L2 (`_search_over_l2`), whose counting passes once read them: on the H200
    its rows matched the reference's on 0.065 of 32K-key rows."""
    from dsaserve.kernels import triton_indexer
    from dsaserve.kernels.triton_indexer_gemm import _select
    from tests.kernels.test_gpu_attention import _position_ordered_topk

    width, k, ps = triton_indexer.ROW_IN_REGS_MAX + 640, 64, 64
    n = 3
    s = randn(n, width, gen=gen)
    pos = torch.tensor([width - 1, width - 700, 5000], device=DEVICE)
    for r in range(n):
        s[r, int(pos[r]) + 1:] = garbage
    table = torch.randperm(n * (width // ps), generator=gen, device=DEVICE).view(n, -1)
    req = torch.arange(n, device=DEVICE)
    out = torch.full((n, k), -7, dtype=torch.int64, device=DEVICE)
    _select(s, table, req, pos, out, k, ps, select)
    for r in range(n):
        j = _position_ordered_topk(s[r], int(pos[r]), k)
        assert torch.equal(out[r], table[r, j // ps] * ps + j % ps), f"seed {gen.initial_seed()} row {r}"
