"""GPU DSA indexer selection paths against their references: the long-row decode selection
(`kernels/triton_indexer_long.py`) and the prefill GEMM + streaming top-k (`kernels/triton_indexer_prefill.py`).
Set-up and error bounds: tests/kernels/gpu_common.py. Small shapes run under the Triton interpreter; the
model's (GLM-5.3: 32 heads x 128, top-2048, rows up to 202752 keys) only on CUDA."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import get_kv_layout
from tests.kernels.gpu_common import (
    BIG,
    DEVICE,
    assert_within_q_rounding,
    gpu_modules,
    kernel_q,
    poison_free_memory,
    randn,
    requires_gpu_kernels,
)
from tests.kernels.test_gpu_attention import _check_kernel_topk, _check_topk, _indexer_case, _position_ordered_topk

pytestmark = requires_gpu_kernels


def _rows(gen, kind, n, width, separated=0):
    """Score rows of a kind; "separated": the first `separated` keys ~1e6 above the rest."""
    s = randn(n, width, gen=gen)
    return {"ties": lambda: (s * 3).round(), "all_equal": lambda: torch.full_like(s, 1.5),
            "negative": lambda: -s.abs() - 10, "narrow": lambda: 1.0 + s * 1e-6,
            "relu_zeros": lambda: s.clamp(min=0) * torch.sign(randn(n, width, gen=gen)),
            "sink_and_recent": lambda: s + 50 * (torch.arange(width, device=DEVICE) < 4) +
            torch.linspace(0, 3, width, device=DEVICE),
            "separated": lambda: s + 1e6 * (torch.arange(width, device=DEVICE) < separated),
            "normal": lambda: s}[kind]()


# ---- long-row decode selection ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["normal", "ties", "all_equal", "negative", "narrow", "relu_zeros",
                                  "sink_and_recent", "separated"])
def test_long_row_select_takes_the_kth_key_exactly(gen, kind):
    """The multi-program radix select returns what the one-program kernel does: every key above the k-th,
    then ties in position order, as slots, in position order; rows shorter than k take all, -1 padded.
    "separated" (exactly k keys in the k-th key's top-byte bucket) ends the search after round 0; on
    "normal" rows the 24-bit bucket usually holds the k-th key alone (round 3 skipped)."""
    _check_long_row_select(gen, kind, *((6, 202752, 2048, 4096, 64) if BIG else (4, 1400, 64, 256, 16)))


@pytest.mark.parametrize("kind", ["normal", "ties"])
def test_long_row_select_sums_the_earlier_chunks_past_one_prefix_block(gen, kind):
    """More chunks than the write kernel sums a step (PREFIX_BLOCK): a chunk's slots start after every earlier
    chunk's, over several steps (128-key chunks: 1584 over the model's context, 140 under the interpreter)."""
    from dsaserve.kernels.triton_indexer_long import PREFIX_BLOCK

    n, width, k, chunk, ps = (3, 202752, 2048, 128, 64) if BIG else (2, 128 * 140, 64, 128, 16)
    assert width // chunk > PREFIX_BLOCK
    _check_long_row_select(gen, kind, n, width, k, chunk, ps, pos_from=(PREFIX_BLOCK + 1) * chunk)


def _check_long_row_select(gen, kind: str, n: int, width: int, k: int, chunk: int, ps: int,
                           pos_from: int | None = None) -> None:
    """long_row_select over `n` rows of a kind, the tokens at positions from `pos_from` (width // 3) on but the last
    (below k), against the position-ordered top-k."""
    from dsaserve.kernels.triton_indexer_long import long_row_select

    s = _rows(gen, kind, n, width, separated=k)
    pos = torch.randint(width // 3 if pos_from is None else pos_from, width, (n,), generator=gen, device=DEVICE)
    pos[-1] = k // 2  # a token that sees fewer than k keys
    table = torch.randperm(n * (width // ps), generator=gen, device=DEVICE).view(n, -1)
    req = torch.arange(n, device=DEVICE)
    poison_free_memory()
    out = torch.full((n, k), -7, dtype=torch.int64, device=DEVICE)
    long_row_select(s, table, req, pos, out, k, ps, chunk=chunk)
    for r in range(n):
        p = int(pos[r])
        if p < k:
            j = torch.arange(p + 1, device=DEVICE)
            want = torch.cat([table[r, j // ps] * ps + j % ps, torch.full((k - p - 1,), -1, device=DEVICE)])
        else:
            j = _position_ordered_topk(s[r], p, k)
            want = table[r, j // ps] * ps + j % ps
        assert torch.equal(out[r], want), f"seed {gen.initial_seed()} row {r}"


@pytest.mark.skipif(not BIG, reason="the model's context bound: CUDA only")
def test_indexer_topk_long_context_decode_selects_the_reference_keys(gen):
    """The dispatcher takes the long-row path past 16K keys; the selection is the reference's (near-ties aside)."""
    from dsaserve.kernels import triton_indexer_dispatch

    ps, hi, d, topk = 64, 32, 128, 2048
    seq_lens, ext = [40000, 3000, 70000], [1, 1, 1]
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, ps, hi, d)
    assert table.shape[1] * ps > gpu_modules()[1].ROW_IN_REGS_MAX
    got = triton_indexer_dispatch.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps)
    _check_kernel_topk(got, q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_long_context_decode_replays_from_a_cuda_graph(gen):
    """The long-row path allocates and launches only: a captured step replays with new positions."""
    from dsaserve.kernels import triton_indexer_dispatch

    ps, hi, d, topk = 64, 32, 128, 2048
    seq_lens, ext = [30000, 20000], [1, 1]
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, ps, hi, d)
    run = lambda: triton_indexer_dispatch.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps)
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    q.copy_(randn(*q.shape, gen=gen, dtype=q.dtype))
    pos.copy_(torch.tensor([25000, 1000], device=DEVICE))  # the second token now sees fewer than topk keys
    graph.replay()
    _check_kernel_topk(out, q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed())
    first = out.clone()
    graph.replay()  # again: each cooperative launch leaves its shared workspace zero for the next replay
    assert torch.equal(out, first)


@pytest.mark.skipif(DEVICE != "cuda", reason="a cooperative launch: its barriers never open under the interpreter")
@pytest.mark.parametrize("seq_lens,keys", [([32768], "normal"), ([131072], "normal"), ([202752], "normal"),
                                           ([32768, 131000], "normal"), ([40000, 1500], "normal"),
                                           ([70000], "repeated"), ([20000, 9000], "repeated")])
@pytest.mark.parametrize("keys_first", [True, False])
def test_scores_and_select_in_one_launch_equal_the_two_apart(gen, seq_lens, keys, keys_first, monkeypatch):
    """`coop_score_select` (decode's 1-2 rows over the FP8 cache) writes the slots the paged score kernel and the
    cooperative select write, bit for bit, at the fused chunks these contexts give (1 row: 256 to 2048 keys;
    2 rows: 512 to 2048, past what decode takes, FUSED_MAX_CHUNK): the same score tiles, each program reading back
    only its own chunk. "repeated": every page holds the same 64 keys, so ties at the k-th key span every chunk; a
    token that sees fewer than top-k keys takes them all; positions land mid-chunk. keys_first: the chunk's scores
    in registers, one MMA over the chunk (`KEYS_FIRST`), or tile by tile through the score buffer."""
    from dsaserve.kernels import triton_indexer_coop, triton_indexer_paged
    from dsaserve.kernels.variants import fused_select_chunk

    monkeypatch.setattr(triton_indexer_coop, "KEYS_FIRST", keys_first)

    ps, hi, d, topk = 64, 32, 128, 2048
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, [1] * len(seq_lens), ps, hi, d)
    if keys == "repeated":
        cache.copy_(cache[:1].expand_as(cache))
    pos[0] -= 777  # mid-chunk, not at the row's end
    n_cols = table.shape[1] * ps
    chunk = fused_select_chunk(len(pos), n_cols)
    got = torch.full((len(pos), topk), -7, dtype=torch.int64, device=DEVICE)
    triton_indexer_coop.coop_score_select(q, w, cache, table, req, pos, got, topk, ps, chunk)
    scores = triton_indexer_paged.paged_index_scores(q, w, cache, table, req, pos, ps, skip_below=topk)
    want = torch.full_like(got, -7)
    triton_indexer_coop.coop_select(scores, table, req, pos, want, topk, ps, chunk)
    assert torch.equal(got, want), f"seed {gen.initial_seed()} chunk {chunk}"
    assert triton_indexer_coop.ready_for_next_launch(triton_indexer_coop.coop_workspace(q.device))  # both launches
    if keys == "normal":
        _check_kernel_topk(got, q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed())


# ---- prefill: FP8 GEMM + streaming top-k -----------------------------------------------------------
# (heads, head dim, topk) of GLM-5.3, glm-5.3-mini and glm-5.3-tiny; the interpreter takes GLM-5.3's heads
# with a small top-k. (bn, cap) force a compaction every few tiles where the default buffer would hold it all.
PREFILL_SHAPES = [(32, 128, 2048 if BIG else 64), (16, 64, 64), (16, 32, 8)]


def _prefill_inputs(gen, hi, d, topk):
    ps = 64 if BIG else 16
    seq_lens, ext = ([9000, 2500, 4200], [256, 1024, 64]) if BIG else ([520, 40, 200], [12, 40, 5])
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, ps, hi, d)
    w -= 0.3  # some heads count against a key
    conf = None if BIG else {"bn": 32, "cap": _next_pow2(topk + 64)}
    return q, w, cache, table, req, pos, ps, seq_lens, ext, conf


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("hi,d,topk", PREFILL_SHAPES)
def test_prefill_topk_fp8_selects_the_top_keys_of_its_scores(gen, hi, d, topk):
    """FP8 q: the selection is the exact top-k of the scores the kernel computes (q rounded to e4m3, checked
    in float64), and against the reference every selected score is within twice the largest score change
    that rounding q makes (the bound for a top-k of perturbed scores)."""
    from dsaserve.kernels import reference as R
    from dsaserve.kernels.triton_indexer_prefill import prefill_topk

    q, w, cache, table, req, pos, ps, seq_lens, ext, conf = _prefill_inputs(gen, hi, d, topk)
    poison_free_memory()
    got = prefill_topk(q, w, cache, get_kv_layout("fp8_ds_mla"), table, req, pos, topk, ps, seq_lens, ext,
                       q_fp8=True, config=conf)
    assert got.shape == (len(pos), topk) and got.dtype == torch.int64
    q8 = kernel_q(q, True, reciprocal=True)  # the streaming kernel quantises q as prepare_q does
    # Hopper's FP8 tensor-core dot accumulates with ~13 bits (as in test_gpu_indexer_gemm): on the H200 picked keys
    # scored 1.0e-4 and 1.9e-4 of the row's max below the k-th in float64 (2026-12-02, two random seeds)
    _check_topk(got, q8, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed(), tol=2.0 ** -12)
    ref = R.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, seq_lens, ext)
    assert_within_q_rounding(got, ref, q, q8, w, cache, table, req, pos, ps, gen.initial_seed())


@pytest.mark.parametrize("hi,d,topk", PREFILL_SHAPES)
def test_prefill_topk_fp16_q_selects_the_reference_keys_in_position_order(gen, hi, d, topk):
    """DSASERVE_FP8_ACTIVATIONS=0 (q / s in fp16: the bf16 input to 2^-12): the exact top-k of the kernel's
    scores, the reference's selection up to the near-ties that rounding makes (on the H200 ~10 % of 8K-key rows
    part at the k-th: the scores' spacing there is ~1/n of their spread, below q's 2^-12 rounding), written in
    position order and -1 padded."""
    from dsaserve.kernels import reference as R
    from dsaserve.kernels.triton_indexer_prefill import prefill_topk

    q, w, cache, table, req, pos, ps, seq_lens, ext, conf = _prefill_inputs(gen, hi, d, topk)
    got = prefill_topk(q, w, cache, get_kv_layout("fp8_ds_mla"), table, req, pos, topk, ps, seq_lens, ext,
                       q_fp8=False, config=conf)
    q16 = kernel_q(q, False, reciprocal=True)
    _check_topk(got, q16, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed())
    ref = R.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, seq_lens, ext)
    assert_within_q_rounding(got, ref, q, q16, w, cache, table, req, pos, ps, gen.initial_seed())
    _assert_position_order(got, table, req, pos, seq_lens, ps, gen.initial_seed())


# ---- dispatch ---------------------------------------------------------------------------------------
def test_indexer_topk_dispatches_by_batch_shape_and_row_length(gen, monkeypatch):
    """The registered indexer_topk (`triton_indexer_dispatch`): prefill-size batches with FP8 keys take the tiled
    score GEMM + select (the default) or, with DSASERVE_INDEXER_PREFILL=stream, the GEMM + streaming top-k
    (bf16 keys keep torch.topk); decode batches whose static row bound passes ROW_IN_REGS_MAX take the split radix
    select. Thresholds lowered so small inputs cross them."""
    from dsaserve.common import envs
    from dsaserve.kernels import triton_indexer as idx
    from dsaserve.kernels import (
        triton_indexer_coop,
        triton_indexer_dispatch,
        triton_indexer_gemm,
        triton_indexer_long,
        triton_indexer_prefill,
    )

    calls = []
    for mod, name in ((triton_indexer_prefill, "prefill_topk"), (triton_indexer_long, "long_row_select"),
                      (triton_indexer_gemm, "gemm_topk"), (triton_indexer_coop, "coop_score_select"),
                      (triton_indexer_coop, "coop_select")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    monkeypatch.setattr(idx, "SELECT_MAX_ROWS", 8)
    monkeypatch.setattr(idx, "ROW_IN_REGS_MAX", 256)
    ps, hi, d, topk = 16, 16, 32, 24
    few = ["coop_score_select"] if DEVICE == "cuda" else ["long_row_select"]
    for layout, seq_lens, ext, want, switch in (
            ("fp8_ds_mla", [300, 60], [6, 9], ["gemm_topk", "long_row_select"], "gemm"),
            ("fp8_ds_mla", [300, 60], [6, 9], ["prefill_topk"], "stream"),
            ("bf16", [300, 60], [6, 9], [], "gemm"),
            ("fp8_ds_mla", [300, 40, 500], [1, 1, 1], ["long_row_select"], "gemm"),
            # 1-2 rows: scores and select in one cooperative launch on a GPU (the interpreter runs no barrier:
            # scores, then the select's launches in their own chunk, variants.long_select_chunk)
            ("fp8_ds_mla", [500], [1], few, "gemm"),
            ("fp8_ds_mla", [500, 300], [1, 1], few, "gemm"),
            ("bf16", [500], [1], ["coop_select"] if DEVICE == "cuda" else ["long_row_select"], "gemm")):
        q, w, cache, table, req, pos = _indexer_case(gen, layout, seq_lens, ext, ps, hi, d)
        calls.clear()
        with envs.override(DSASERVE_INDEXER_PREFILL=switch):
            got = triton_indexer_dispatch.indexer_topk(q, w, cache, layout, table, req, pos, topk, ps, seq_lens, ext)
        assert calls == want, (layout, ext, calls)
        if want == ["prefill_topk"]:
            assert torch.equal(got, triton_indexer_prefill.prefill_topk(q, w, cache, layout, table, req, pos, topk, ps,
                                                                       seq_lens, ext))
        if want[:1] == ["gemm_topk"]:
            assert torch.equal(got, triton_indexer_gemm.gemm_topk(q, w, cache, layout, table, req, pos, topk, ps,
                                                                 seq_lens, ext))
        prefill = want[:1] in (["prefill_topk"], ["gemm_topk"])
        # the interpreter's bf16 dot (the plain layouts' decode scores) is broken in Triton 3.9
        if DEVICE == "cuda" or prefill or not get_kv_layout(layout).plain_dtype:
            _check_kernel_topk(got, q, w, cache, layout, table, req, pos, topk, ps, gen.initial_seed())


def _assert_position_order(got, table, req, pos, seq_lens, ps, seed):
    page_of = torch.full((int(table.max()) + 1,), -1, dtype=torch.int64, device=DEVICE)
    for t in range(len(pos)):
        r, n = int(req[t]), int((got[t] >= 0).sum())
        used = -(-seq_lens[r] // ps)  # the table's tail is padding (page 0)
        page_of[table[r, :used]] = torch.arange(used, device=DEVICE)
        key_pos = page_of[got[t, :n] // ps] * ps + got[t, :n] % ps
        assert (key_pos.diff() > 0).all() and (got[t, n:] == -1).all(), f"seed {seed} token {t}"


@pytest.mark.parametrize("topk,page_size,pages", [(64, 16, 4), (100, 16, 5), (2048, 64, 17)])
def test_take_all_is_every_visible_key(topk, page_size, pages):
    """`triton_indexer.take_all` (a row bound <= topk: every key 0..position selected) equals the torch formula it
    replaced: each visible key's physical slot through its request's page table, -1 past the position and past
    the table, whatever topk's tail."""
    ti = gpu_modules()[1]
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    max_seq = pages * page_size
    page_table = torch.randperm(40 * pages, generator=gen, device=DEVICE)[:3 * pages].view(3, pages).to(torch.int32)
    req_index = torch.tensor([2, 0, 1, 2, 0], device=DEVICE)
    positions = torch.tensor([0, max_seq - 1, page_size, max_seq // 2 + 3, 1], device=DEVICE)
    got = ti.take_all(page_table, req_index, positions, topk, page_size)
    want = torch.full((5, topk), -1, dtype=torch.int64, device=DEVICE)
    j = torch.arange(min(max_seq, topk), device=DEVICE)
    slots = page_table[req_index[:, None], j // page_size].long() * page_size + j % page_size
    want[:, :j.numel()] = slots.masked_fill_(j[None, :] > positions[:, None], -1)
    assert got.dtype == torch.int64 and torch.equal(got, want)
