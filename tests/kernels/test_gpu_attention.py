"""GPU attention-side kernels against their references: the indexer (scores, top-k selection, slot
translation), sparse MLA, the absorbed per-head GEMMs, and the KV / indexer-key writes.
Set-up and error bounds: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.index_pages import read_rows
from dsaserve.common.kv_layout import decode_latent, encode_index_k, encode_latent, get_kv_layout
from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import (
    BF16,
    BIG,
    DEVICE,
    ENC_BYTES,
    ENC_REL,
    MODELS,
    SLACK,
    SMALL_ROWS,
    assert_within_q_rounding,
    decode_q,
    gpu_modules,
    index_cache_of,
    index_keys,
    kernel_q,
    poison_free_memory,
    randn,
    rel,
    requires_gpu_kernels,
)

pytestmark = requires_gpu_kernels


# ---- indexer top-k ---------------------------------------------------------------------------------
def _indexer_case(gen, layout, seq_lens, ext, ps, hi, d):
    n_pages = sum(-(-s // ps) for s in seq_lens) + 3
    cache = index_cache_of(randn(n_pages * ps, d, gen=gen), layout, ps)
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
    q = randn(len(pos), hi, d, gen=gen, dtype=torch.bfloat16)
    w = torch.rand(len(pos), hi, generator=gen, device=DEVICE)
    return q, w, cache, table, req, pos


def _check_kernel_topk(got, q, w, cache, layout, table, req, pos, topk, ps, seed):
    """`_check_topk` against the scores of q as the kernels round it (`decode_q`: FP8 layouts take q / s in e4m3,
    whose tensor-core dot accumulates with ~13 bits, so picked keys may sit 2^-12 of the row's max below the k-th)."""
    tol = 1e-4 if get_kv_layout(layout).plain_dtype else 2.0 ** -12
    _check_topk(got, decode_q(q, layout), w, cache, layout, table, req, pos, topk, ps, seed, tol=tol)


def _check_topk(got, q, w, cache, layout, table, req, pos, topk, ps, seed, tol=1e-4):
    """`tol` x the row's largest |score|: how far below the k-th a picked key's float64 score may be."""
    keys = index_keys(cache, layout, q.shape[-1]).double()
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
        assert picked.min() >= kth - tol * scores.abs().max(), f"seed {seed} token {t}"


@pytest.mark.parametrize("layout,topk", [("fp8_ds_mla", 256), ("bf16", 256), ("fp8_ds_mla", 2048)])
def test_indexer_topk_selects_the_reference_keys(gen, layout, topk):
    idx = gpu_modules()[1]
    ps, hi, d = (64, 32, 128) if BIG else (16, 16, 32)
    topk = topk if BIG else topk // 10  # 2048 / 204: more than the page table holds -> every visible key
    seq_lens, ext = ([300, 1000, 77, 513], [1, 1, 77, 5]) if BIG else ([37, 5, 50], [3, 5, 1])
    q, w, cache, table, req, pos = _indexer_case(gen, layout, seq_lens, ext, ps, hi, d)
    poison_free_memory()
    got = idx.indexer_topk(q, w, cache, layout, table, req, pos, topk, ps, seq_lens, ext)
    assert got.shape == (len(pos), topk) and got.dtype == torch.int64
    _check_kernel_topk(got, q, w, cache, layout, table, req, pos, topk, ps, gen.initial_seed())
    ref = R.indexer_topk(q, w, cache, layout, table, req, pos, topk, ps, seq_lens, ext)
    if get_kv_layout(layout).plain_dtype:
        same = sum(sorted(a.tolist()) == sorted(b.tolist()) for a, b in zip(got, ref, strict=True))
        assert same >= len(pos) - 1, f"seed {gen.initial_seed()}: {same}/{len(pos)} rows equal the reference's set"
    else:  # q's rounding parts near-ties at the k-th from the reference's float q, nothing else
        assert_within_q_rounding(got, ref, q, decode_q(q, layout), w, cache, table, req, pos, ps, gen.initial_seed())


@pytest.mark.parametrize("model", MODELS)
def test_indexer_topk_takes_each_models_shapes(gen, model):
    """The config's indexer heads x dim and top-k (GLM-5.3 32 x 128, top-2048; mini 16 x 64, top-64): a decode row
    and a prefill chunk past the top-k (scores + selection), and a request shorter than it (every key)."""
    cfg, idx = MODELS[model], gpu_modules()[1]
    topk, ps = cfg.index_topk, 64
    seq_lens, ext = [3 * topk + 5, topk // 2, topk + 40], [1, topk // 2, 3]
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, ps, cfg.index_n_heads,
                                                 cfg.index_head_dim)
    poison_free_memory()
    got = idx.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, seq_lens, ext)
    assert got.shape == (len(pos), topk)
    _check_kernel_topk(got, q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed())


def test_indexer_topk_takes_a_head_dim_that_is_not_a_power_of_two(gen):
    """192: the page-major kernel's K block is 256 wide; the columns past 192 are masked, not read from the next
    key."""
    idx = gpu_modules()[1]
    seq_lens, ext = [150, 30], [2, 1]
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, 64, 16, 192)
    got = idx.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, 64, 64, seq_lens, ext)
    _check_kernel_topk(got, q, w, cache, "fp8_ds_mla", table, req, pos, 64, 64, gen.initial_seed())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_indexer_topk_replays_from_a_cuda_graph(gen):
    idx = gpu_modules()[1]
    ps, hi, d, topk = 64, 32, 128, 128
    seq_lens, ext = [700, 90, 300], [1, 1, 1]
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, ps, hi, d)
    idx.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = idx.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps)
    q.copy_(randn(*q.shape, gen=gen, dtype=q.dtype))
    pos.copy_(torch.tensor([650, 40, 299], device=DEVICE))
    graph.replay()
    _check_kernel_topk(out, q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed())


@pytest.mark.parametrize("n_keys,k", [(3000, 2048), (600, 64), (40, 64)])
def test_topk_select_paths_pick_the_same_slots(gen, n_keys, k):
    """The in-register bisection (rows up to 16K keys) and the L2 one (longer rows) on the same scores."""
    idx = gpu_modules()[1]
    width = 4096
    scores = randn(2, width, gen=gen)
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
    idx = gpu_modules()[1]
    n, k = 4, (64 if width == 512 else 2048)
    s = randn(n, width, gen=gen)
    s = {"ties": lambda: (s * 3).round(), "all_equal": lambda: torch.full_like(s, 1.5),
         "negative": lambda: -s.abs() - 10, "wide": lambda: s * torch.exp(randn(n, width, gen=gen) * 20),
         "narrow": lambda: 1.0 + s * 1e-6, "relu_zeros": lambda: s.clamp(min=0) * torch.sign(randn(n, width, gen=gen)),
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


# ---- sparse MLA ------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16", "fp8_e4m3", "fp32"])
@pytest.mark.parametrize("t", [1, 5, 200] if BIG else [1, 3])
def test_sparse_mla_attention_matches_reference(gen, layout, t):
    mla = gpu_modules()[4]
    h, dc, dr, k, n_slots = (64, 512, 64, 2048, 4096) if BIG else (4, 128, 16, 40, 200)
    latent = randn(n_slots, dc + dr, gen=gen)
    cache = encode_latent(latent, layout, dc)
    slots = torch.randint(0, n_slots, (t, k), generator=gen, device=DEVICE)
    slots[0, k // 3: k // 2] = -1  # a partly filled selection (short context)
    qn, qr = randn(t, h, dc, gen=gen, dtype=torch.bfloat16), randn(t, h, dr, gen=gen, dtype=torch.bfloat16)
    poison_free_memory()
    got = mla.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc)
    ref = R.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc)
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got).all()
    assert rel(got, ref) < BF16, f"seed {gen.initial_seed()}"
    unsplit = mla.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc, config={"splits": 1})
    assert rel(unsplit, ref) < BF16, f"seed {gen.initial_seed()}"
    if layout == "fp8_ds_mla":  # the 4-group kernel (scales outside the dots; each group dequantised apart)
        for grouped in (True, "dequant"):
            got = mla.sparse_mla_attention(qn, qr, cache, layout, slots, 0.04, dc, config={"grouped": grouped})
            assert rel(got, ref) < BF16, f"seed {gen.initial_seed()} grouped={grouped}"


@pytest.mark.parametrize("t", [1, 3, 40])
def test_sparse_mla_attention_in_float32_is_not_rounded_to_bf16(gen, t):
    """A float32 model's queries (eval's GPU-in-float32 comparison) at glm-5.3-mini's latent (the generic kernel):
    float32 operands and products, within summation order of the reference, far inside what rounding q and the
    probabilities to bf16 cost (they were, until 2026-12-05)."""
    mla = gpu_modules()[4]
    h, dc, dr, k, n_slots = 6, 256, 32, 64, 300
    cache = encode_latent(randn(n_slots, dc + dr, gen=gen), "fp8_ds_mla", dc)
    slots = torch.randint(0, n_slots, (t, k), generator=gen, device=DEVICE)
    slots[0, k // 3: k // 2] = -1
    qn, qr = randn(t, h, dc, gen=gen), randn(t, h, dr, gen=gen)
    poison_free_memory()
    got = mla.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.04, dc)
    ref = R.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.04, dc)
    via_bf16 = rel(R.sparse_mla_attention(qn.bfloat16().float(), qr.bfloat16().float(), cache, "fp8_ds_mla", slots,
                                          0.04, dc), ref)
    assert got.dtype == torch.float32 and rel(got, ref) < 1e-5 < via_bf16 / 10, f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("model", MODELS)
def test_sparse_mla_attention_takes_each_models_shapes(gen, model, layout):
    """The config's heads, kv_lora + rope and top-k: decode (split, then combined) and a prefill-size batch."""
    cfg, mla = MODELS[model], gpu_modules()[4]
    h, dc, dr, k = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.index_topk
    n_slots = 4 * k
    cache = encode_latent(randn(n_slots, dc + dr, gen=gen), layout, dc)
    for t in (1, 2, 7):
        slots = torch.randint(0, n_slots, (t, k), generator=gen, device=DEVICE)
        slots[-1, k // 2:] = -1
        qn, qr = randn(t, h, dc, gen=gen, dtype=torch.bfloat16), randn(t, h, dr, gen=gen, dtype=torch.bfloat16)
        poison_free_memory()
        ref = R.sparse_mla_attention(qn, qr, cache, layout, slots, dc ** -0.5, dc)
        for conf in ({}, {"splits": 2}, {"splits": 1}):
            got = mla.sparse_mla_attention(qn, qr, cache, layout, slots, dc ** -0.5, dc, config=conf)
            assert torch.isfinite(got).all() and rel(got, ref) < BF16, f"seed {gen.initial_seed()} t={t} {conf}"


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16"])
def test_sparse_mla_attention_stops_at_each_tokens_last_valid_slot(gen, layout):
    """Tokens seeing fewer keys than top-k (valid slots first, -1 after, as every selection writes them) at
    lengths around the tile size, split and unsplit; one row with a -1 hole before its last valid slot."""
    mla = gpu_modules()[4]
    h, dc, dr, k, n_slots = (64, 512, 64, 2048, 4096) if BIG else (4, 128, 16, 96, 200)
    lengths = [1, 31, 32, 33, 65, k // 2, k - 1, k, 0]
    cache = encode_latent(randn(n_slots, dc + dr, gen=gen), layout, dc)
    slots = torch.randint(0, n_slots, (len(lengths), k), generator=gen, device=DEVICE)
    for r, n in enumerate(lengths):
        slots[r, n:] = -1
    slots[4, 40:50] = -1
    qn = randn(len(lengths), h, dc, gen=gen, dtype=torch.bfloat16)
    qr = randn(len(lengths), h, dr, gen=gen, dtype=torch.bfloat16)
    ref = R.sparse_mla_attention(qn[:-1], qr[:-1], cache, layout, slots[:-1], dc ** -0.5, dc)
    # scan 0: the top-k split statically (no valid-slot scan), the -1 tails masked (their splits not read by the
    # combine); grouped: the 4-group kernel (kv_lora 512)
    confs = [{}, {"splits": 1}, {"splits": 3}, {"scan": 0}, {"scan": 0, "splits": 1}, {"scan": 0, "splits": 5}] + (
        [{"scan": 0, "grouped": "dequant", "block_h": 16}] if dc == 512 else [])
    for conf in confs:
        poison_free_memory()
        got = mla.sparse_mla_attention(qn, qr, cache, layout, slots, dc ** -0.5, dc, config=conf)
        assert rel(got[:-1], ref) < BF16, f"seed {gen.initial_seed()} {conf}"
        assert got[-1].eq(0).all(), conf


def test_sparse_mla_config_switch_applies_to_batches_and_names_itself_on_bad_input(gen):
    """DSASERVE_SPARSE_MLA_CONFIG (a sweep's winner tried in a whole model): applied from 3 tokens on, checked."""
    from dsaserve.common import envs

    mla = gpu_modules()[4]
    cache = encode_latent(randn(200, 144, gen=gen), "fp8_ds_mla", 128)
    slots = torch.randint(0, 200, (4, 40), generator=gen, device=DEVICE)
    qn, qr = randn(4, 4, 128, gen=gen, dtype=torch.bfloat16), randn(4, 4, 16, gen=gen, dtype=torch.bfloat16)
    ref = R.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.1, 128)
    with envs.override(DSASERVE_SPARSE_MLA_CONFIG='{"block_k": 16, "num_stages": 1}'):
        assert rel(mla.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.1, 128), ref) < BF16
    for bad in ('{"block": 16}', "block_k=16"):
        with envs.override(DSASERVE_SPARSE_MLA_CONFIG=bad), pytest.raises(ValueError, match="SPARSE_MLA_CONFIG"):
            mla.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.1, 128)

def test_sparse_mla_attention_gives_zeros_for_a_token_with_no_slots(gen):
    mla = gpu_modules()[4]
    latent = randn(50, 144, gen=gen)
    cache = encode_latent(latent, "fp8_ds_mla", 128)
    slots = torch.full((2, 32), -1, device=DEVICE)
    slots[1, :5] = torch.arange(5)
    qn, qr = randn(2, 4, 128, gen=gen, dtype=torch.bfloat16), randn(2, 4, 16, gen=gen, dtype=torch.bfloat16)
    got = mla.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.1, 128)
    assert got[0].eq(0).all()
    ref = R.sparse_mla_attention(qn[1:], qr[1:], cache, "fp8_ds_mla", slots[1:], 0.1, 128)
    assert rel(got[1:], ref) < BF16


@pytest.mark.parametrize("t", [1, 3, 17, 40])
@pytest.mark.parametrize("model", MODELS)
def test_head_bmm_matches_reference_and_attaches_the_fp8_copy(gen, model, t):
    """Absorbed-MLA per-head GEMMs: q_nope (a strided slice of q) @ W_uk -> [T, H, kv_lora]; latent @ W_uv ->
    [T, H*v] flattened for o_proj, with the FP8 copy o_proj's GEMM would make (decode sizes, whole 128-column
    groups per head: GLM-5.3's v = 256, not mini's 64)."""
    from dsaserve.kernels import triton_fp8_gemm as G
    from dsaserve.kernels import triton_head_gemm as HG

    poison_free_memory()
    cfg = MODELS[model]
    h, nope, rope = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    dc, v = cfg.kv_lora_rank, cfg.v_head_dim
    q = randn(t, h, nope + rope, gen=gen, dtype=torch.bfloat16)
    w_uk = randn(h, nope, dc, gen=gen, dtype=torch.bfloat16, scale=nope ** -0.5)
    got = HG.head_bmm(q[..., :nope], w_uk)
    assert got.shape == (t, h, dc)
    assert rel(got, R.head_bmm(q[..., :nope].float(), w_uk.float())) < BF16
    latent = randn(t, h, dc, gen=gen, dtype=torch.bfloat16)
    w_uv = randn(h, dc, v, gen=gen, dtype=torch.bfloat16, scale=dc ** -0.5)
    flat = HG.head_bmm(latent, w_uv, flatten=True)
    assert flat.shape == (t, h * v) and rel(flat, R.head_bmm(latent.float(), w_uv.float(), flatten=True)) < BF16
    if t <= SMALL_ROWS and v % 128 == 0:
        q8, s8 = G.cached_fp8(flat)
        ref_q, ref_s = G.quant_act_fp8(flat)
        torch.testing.assert_close(s8, ref_s)
        assert (q8.float() - ref_q.float()).abs().max() <= ref_q.float().abs().max() * 2 ** -3  # <= 1 e4m3 step
    else:
        assert G.cached_fp8(flat) is None


@pytest.mark.parametrize("t", [1, 2, 3])
@pytest.mark.parametrize("model", MODELS)
def test_w_uv_gemm_merges_the_splits_sparse_mla_left(gen, model, t, monkeypatch):
    """defer_combine: a split decode of 1-2 tokens leaves its partials on the output (unwritten) and W_uv's head
    GEMM merges them as it reads them: its product equals the GEMM over the merged latent (one row has a dead
    split: its -1 tail, partials never written: poisoned to NaN); 3 tokens (and every other reader, `take_splits`)
    get the merged output as before. Each K block's partials loaded a block ahead (`FOLD_PREFETCH`) or in their
    block: the same bits."""
    from dsaserve.kernels import triton_head_gemm as HG
    from dsaserve.kernels import triton_sparse_mla as S

    cfg = MODELS[model]
    h, dc, dr, v = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.v_head_dim
    k = max(cfg.index_topk, 512)  # enough keys for 8 splits of whole key tiles
    n_slots = 4 * k
    cache = encode_latent(randn(n_slots, dc + dr, gen=gen), "fp8_ds_mla", dc)
    slots = torch.randint(0, n_slots, (t, k), generator=gen, device=DEVICE)
    slots[0, k // 2:] = -1
    qn, qr = randn(t, h, dc, gen=gen, dtype=torch.bfloat16), randn(t, h, dr, gen=gen, dtype=torch.bfloat16)
    w_uv = randn(h, dc, v, gen=gen, dtype=torch.bfloat16, scale=dc ** -0.5)
    split = {"splits": 8}  # the small configs would not split by themselves
    merged = S.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.04, dc, config=split)
    poison_free_memory()
    left = S.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.04, dc, config=split, defer_combine=True)
    assert (S.pending_splits(left) is not None) == (t <= S.FOLD_MAX_T)
    monkeypatch.setattr(HG, "FOLD_PREFETCH", False)
    in_block = HG.head_bmm(left, w_uv, flatten=True)
    monkeypatch.setattr(HG, "FOLD_PREFETCH", True)
    got = HG.head_bmm(left, w_uv, flatten=True)
    assert torch.equal(got, in_block)
    want = HG.head_bmm(merged, w_uv, flatten=True)
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * float(want.abs().max()))
    assert rel(got, R.head_bmm(R.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.04, dc).float(),
                               w_uv.float(), flatten=True)) < BF16
    assert torch.equal(S.take_splits(left), merged) and S.pending_splits(left) is None


# ---- KV writes -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16", "fp32", "fp8_e4m3"])
@pytest.mark.parametrize("model", MODELS)
def test_mla_kv_write_matches_reference_and_touches_only_its_slots(gen, layout, model):
    kvw = gpu_modules()[2]
    dc, dr = MODELS[model].kv_lora_rank, MODELS[model].qk_rope_head_dim
    t, n_slots = (37, 128) if BIG else (5, 16)
    kv_a = randn(t, dc + dr, gen=gen, dtype=torch.bfloat16)
    wt = (torch.rand(dc, generator=gen, device=DEVICE) + 0.5).bfloat16()
    ang = torch.rand(t, dr // 2, generator=gen, device=DEVICE) * 6
    slots = torch.randperm(n_slots, generator=gen, device=DEVICE)[:t]
    width = encode_latent(kv_a[:1].float(), layout, dc).shape[1]
    poison = torch.randint(0, 256, (n_slots, width), generator=gen, device=DEVICE, dtype=torch.uint8)
    ref_cache, got_cache = poison.clone(), poison.clone()
    ref = R.mla_kv_write(ref_cache, layout, slots, kv_a, wt, 1e-5, ang.cos(), ang.sin(), dc)
    got = kvw.mla_kv_write(got_cache, layout, slots, kv_a, wt, 1e-5, ang.cos(), ang.sin(), dc)
    assert got.dtype == ref.dtype and rel(got, ref) < 5e-3 * SLACK, f"seed {gen.initial_seed()}"
    others = torch.ones(n_slots, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(got_cache[others], poison[others])
    dref, dgot = decode_latent(ref_cache[slots], layout, dc), decode_latent(got_cache[slots], layout, dc)
    assert torch.isfinite(dgot.float()).all()
    # identical bytes except an occasional one-ulp rounding tie (rsqrt / division order)
    assert rel(dgot.float(), dref.float()) < ENC_REL, f"seed {gen.initial_seed()}"
    assert (got_cache[slots] != ref_cache[slots]).float().mean() < ENC_BYTES


def test_mla_kv_write_skips_negative_slots(gen):
    kvw = gpu_modules()[2]
    kv_a = randn(3, 144, gen=gen, dtype=torch.bfloat16)
    cache = torch.zeros(8, 164, dtype=torch.uint8, device=DEVICE)
    ang = torch.rand(3, 8, generator=gen, device=DEVICE)
    kvw.mla_kv_write(cache, "fp8_ds_mla", torch.tensor([2, -1, 5], device=DEVICE), kv_a,
                     torch.ones(128, dtype=torch.bfloat16, device=DEVICE), 1e-5, ang.cos(), ang.sin(), 128)
    assert cache[[0, 1, 3, 4, 6, 7]].eq(0).all() and cache[[2, 5]].ne(0).any(dim=1).all()


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16", "fp32"])
@pytest.mark.parametrize("model", MODELS)
def test_indexer_k_write_matches_the_pool_encoding(gen, layout, model):
    kvw = gpu_modules()[2]
    t, d, n_slots, ps = 9, MODELS[model].index_head_dim, 32, 8
    k = randn(t, d, gen=gen, dtype=torch.bfloat16)
    slots = torch.randperm(n_slots, generator=gen, device=DEVICE)[:t]
    width = encode_index_k(k[:1], layout).shape[1]
    poison = torch.randint(0, 256, (n_slots // ps, ps * width), generator=gen, device=DEVICE, dtype=torch.uint8)
    ref, got = poison.clone(), poison.clone()
    R.indexer_k_write(ref, layout, slots, k)
    kvw.indexer_k_write(got, layout, slots, k)
    others = torch.ones(n_slots, dtype=torch.bool, device=DEVICE)
    others[slots] = False
    every = torch.arange(n_slots, device=DEVICE)
    assert torch.equal(read_rows(got, every[others], layout, d), read_rows(poison, every[others], layout, d))
    assert rel(index_keys(got, layout, d, slots), index_keys(ref, layout, d, slots)) < ENC_REL
    assert (read_rows(got, slots, layout, d) != read_rows(ref, slots, layout, d)).float().mean() < ENC_BYTES


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16", "fp32"])
@pytest.mark.parametrize("model", MODELS)
def test_indexer_k_norm_write_is_layer_norm_rope_and_the_write(gen, layout, model):
    """The fused key path against the reference's LayerNorm + RoPE (GLM interleaved, DeepSeek rotate-half) +
    write: the same rows at the same slots (a slot of -1 writes nothing), other rows untouched."""
    kvw = gpu_modules()[2]
    cfg = MODELS[model]
    t, d, rope, n_slots, ps = 9, cfg.index_head_dim, cfg.qk_rope_head_dim, 32, 8
    k_raw = randn(t, d, gen=gen, dtype=torch.bfloat16, scale=3.0) + 0.5
    weight = (1 + 0.3 * randn(d, gen=gen)).bfloat16()
    bias = (0.2 * randn(d, gen=gen)).bfloat16()
    ang = torch.rand(t, rope // 2, generator=gen, device=DEVICE) * 6
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    slots = torch.randperm(n_slots, generator=gen, device=DEVICE)[:t]
    slots[4] = -1
    width = encode_index_k(k_raw[:1], layout).shape[1]
    poison = torch.randint(0, 256, (n_slots // ps, ps * width), generator=gen, device=DEVICE, dtype=torch.uint8)
    ref, got = poison.clone(), poison.clone()
    interleaved = cfg.model_type == "glm_moe_dsa"
    kept = slots >= 0
    R.indexer_k_norm_write(ref, layout, slots[kept], k_raw[kept], weight, bias, 1e-6, cos[kept], sin[kept], rope,
                           interleaved)
    kvw.indexer_k_norm_write(got, layout, slots, k_raw, weight, bias, 1e-6, cos, sin, rope, interleaved)
    others = torch.ones(n_slots, dtype=torch.bool, device=DEVICE)
    others[slots[kept]] = False
    every = torch.arange(n_slots, device=DEVICE)
    assert torch.equal(read_rows(got, every[others], layout, d), read_rows(poison, every[others], layout, d))
    g, r = index_keys(got, layout, d, slots[kept]), index_keys(ref, layout, d, slots[kept])
    # The kernel's LayerNorm is not torch's CUDA one bit for bit: on the H200 up to 15 % of the bf16 values
    # moved one step, and a key whose amax moves re-quantises its whole row (rel 0.013-0.014 in e4m3). So each
    # value within one step of its encoding (bf16 2^-8 of its magnitude, e4m3 2^-3) of the reference's, the
    # rope's cancelling pairs within 2^-8 of the key's amax (`test_gpu_model._kv_rows_differ`'s rule): a wrong
    # RoPE pair, norm or slot is many steps off
    step = 2 ** -3 if layout == "fp8_ds_mla" else 2 ** -7
    assert ((g - r).abs() <= step * torch.maximum(g.abs(), r.abs()) + 2 ** -8 * r.abs().amax(1, keepdim=True)).all()
    assert rel(g, r) < step / 2


@pytest.mark.parametrize("q_fp8,fill", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("tile", [{"bs": 64, "num_warps": 4, "blocks": 2}, {"bs": 64, "num_warps": 4, "blocks": 4},
                                  {}])
def test_paged_index_scores_are_the_rounded_q_scores_of_each_visible_key(gen, q_fp8, fill, tile):
    """The page-major decode score kernel: every visible key's score is sum_h w_h relu(q'_h . k) of q as it rounds
    it (e4m3 or fp16, one scale a head), keys past a token's position -inf (with `fill`), across runs of tiles and
    pages, the rows' tiles shared among their programs by each row's own length (`row_run`: a 70-key row among
    300-key ones)."""
    from dsaserve.kernels.triton_indexer_paged import paged_index_scores

    ps, hi, d = 16, 16, 64
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", [150, 70, 300], [1, 2, 1], ps, hi, d)
    got = paged_index_scores(q, w, cache, table, req, pos, ps, tile=tile, q_fp8=q_fp8, fill=fill)
    qk = kernel_q(q, q_fp8, reciprocal=True)
    keys = index_keys(cache, "fp8_ds_mla", d).double()
    for t in range(len(pos)):
        p = int(pos[t])
        j = torch.arange(p + 1, device=DEVICE)
        slots = table[int(req[t]), j // ps] * ps + j % ps
        want = ((qk[t] @ keys[slots].t()).relu() * w[t, :, None].double()).sum(0)
        if fill:
            assert torch.isinf(got[t, p + 1:]).all() and (got[t, p + 1:] < 0).all()
        assert (got[t, :p + 1].double() - want).abs().max() <= 2.0 ** -12 * want.abs().max() + 1e-6
