"""Reference kernels (the spec the GPU kernels are tested against) checked against plain dense math.

Each test recomputes an op the slow, obvious way (loops over tokens / heads / blocks, dense softmax, brute
force top-k) on small random inputs and compares. CPU only, a few seconds in all.
"""

from __future__ import annotations

import math

import pytest
import torch

from dsaserve.common import index_pages
from dsaserve.common.kv_layout import decode_index_k, decode_latent, encode_index_k, encode_latent
from dsaserve.kernels import reference as R
from dsaserve.kernels import registry
from dsaserve.weights.fp8 import quantize_fp8_block


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _blockwise_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """w[n, k] = q[n, k] * s[n // 128, k // 128], element block by element block."""
    w = torch.empty(q.shape, dtype=torch.float64)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            w[blk] = q[blk].double() * s[i, j].double()
    return w


@pytest.mark.parametrize("m,n,k", [(1, 256, 384), (5, 200, 300), (33, 128, 129)])
def test_fp8_linear_is_the_dequantised_matmul(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    want = x.double() @ _blockwise_dequant(q, s).t()
    assert _rel(R.fp8_linear(x, q, s), want) < 1e-6
    assert R.fp8_linear(x.bfloat16(), q, s).dtype == torch.bfloat16


def test_apply_rope_interleaved_is_a_complex_rotation_of_pairs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 2, 8, generator=g)
    ang = torch.rand(3, 4, generator=g) * 7
    got = R.apply_rope(x, ang.cos(), ang.sin(), interleaved=True)
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(ang), ang)[:, None, :]
    assert torch.allclose(got, torch.cat([z.real, z.imag], dim=-1), atol=1e-6)
    half = R.apply_rope(x, ang.cos(), ang.sin(), interleaved=False)
    z = torch.complex(x[..., :4], x[..., 4:]) * torch.polar(torch.ones_like(ang), ang)[:, None, :]
    assert torch.allclose(half, torch.cat([z.real, z.imag], dim=-1), atol=1e-6)


@pytest.mark.parametrize("layout", ["fp32", "bf16", "fp8_ds_mla"])
def test_mla_kv_write_normalises_rotates_and_stores_at_the_slots(layout):
    g = torch.Generator().manual_seed(2)
    t, dc, dr = 4, 128, 16
    kv_a = torch.randn(t, dc + dr, generator=g)
    w = torch.rand(dc, generator=g) + 0.5
    ang = torch.rand(t, dr // 2, generator=g) * 6
    slots = torch.tensor([5, 0, 9, 2])
    cache = torch.zeros(12, encode_latent(kv_a, layout, dc).shape[1], dtype=torch.uint8)
    latent = R.mla_kv_write(cache, layout, slots, kv_a, w, 1e-6, ang.cos(), ang.sin(), dc)
    for i in range(t):
        x = kv_a[i, :dc].double()
        nope = w.double() * x / math.sqrt(x.pow(2).mean() + 1e-6)
        rope = R.apply_rope(kv_a[i:i + 1, dc:], ang[i:i + 1].cos(), ang[i:i + 1].sin(), True)[0]
        assert _rel(latent[i, :dc], nope) < 1e-6
        assert torch.allclose(latent[i, dc:], rope)
    stored = decode_latent(cache[slots], layout, dc).float()
    tol = {"fp32": 1e-7, "bf16": 5e-3, "fp8_ds_mla": 5e-2}[layout]  # e4m3: 3 mantissa bits
    assert _rel(stored, latent) < tol
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[slots] = False
    assert cache[untouched].eq(0).all()


def _paged_setup(g, seq_lens, ext, page_size, n_pages, d, layout):
    keys = torch.randn(n_pages * page_size, d, generator=g)
    cache = index_pages.pack_pages(encode_index_k(keys, layout), layout, d, page_size)
    max_pages = max(-(-s // page_size) for s in seq_lens)
    perm = torch.randperm(n_pages, generator=g)
    table = perm[: len(seq_lens) * max_pages].view(len(seq_lens), max_pages)
    pos, req = [], []
    for r, (n, e) in enumerate(zip(seq_lens, ext, strict=True)):
        pos += range(n - e, n)
        req += [r] * e
    return cache, table, torch.tensor(pos), torch.tensor(req)


@pytest.mark.parametrize("layout", ["fp32", "fp8_ds_mla"])
def test_indexer_topk_matches_brute_force_over_each_tokens_causal_keys(layout):
    g = torch.Generator().manual_seed(3)
    ps, d, hi, topk = 8, 16, 4, 10
    seq_lens, ext = [21, 6, 30], [4, 6, 1]
    cache, table, pos, req = _paged_setup(g, seq_lens, ext, ps, 16, d, layout)
    q = torch.randn(len(pos), hi, d, generator=g)
    w = torch.rand(len(pos), hi, generator=g)
    got = R.indexer_topk(q, w, cache, layout, table, req, pos, topk, ps, seq_lens, ext)
    keys = decode_index_k(index_pages.read_rows(cache, torch.arange(16 * ps), layout, d), layout).double()
    for t in range(len(pos)):
        r, p = int(req[t]), int(pos[t])
        scored = []
        for j in range(p + 1):
            slot = int(table[r, j // ps]) * ps + j % ps
            s = sum(float(w[t, h]) * max(0.0, float(q[t, h].double() @ keys[slot])) for h in range(hi))
            scored.append((s, slot))
        want = sorted(slot for _, slot in sorted(scored, reverse=True)[:topk])
        row = got[t].tolist()
        assert sorted(x for x in row if x >= 0) == want
        assert row.count(-1) == topk - min(topk, p + 1)


@pytest.mark.parametrize("layout", ["fp32", "bf16", "fp8_ds_mla"])
def test_sparse_mla_attention_is_dense_softmax_over_the_selected_rows(layout):
    g = torch.Generator().manual_seed(4)
    t, h, dc, dr, k = 3, 2, 128, 16, 7
    latent = torch.randn(20, dc + dr, generator=g)
    cache = encode_latent(latent, layout, dc)
    slots = torch.randint(0, 20, (t, k), generator=g)
    slots[1, 2:5] = -1
    qn, qr = torch.randn(t, h, dc, generator=g), torch.randn(t, h, dr, generator=g)
    got = R.sparse_mla_attention(qn, qr, cache, layout, slots, 0.1, dc)
    rows = decode_latent(cache, layout, dc).double()
    for i in range(t):
        sel = [int(s) for s in slots[i] if s >= 0]
        kv = rows[sel]
        for j in range(h):
            logits = (kv[:, :dc] @ qn[i, j].double() + kv[:, dc:] @ qr[i, j].double()) * 0.1
            want = torch.softmax(logits, 0) @ kv[:, :dc]
            assert _rel(got[i, j], want) < 1e-6


def test_moe_route_picks_top_k_by_biased_score_within_top_groups():
    g = torch.Generator().manual_seed(5)
    t, e, k, n_group, topk_group = 6, 16, 3, 4, 2
    logits, bias = torch.randn(t, e, generator=g), torch.randn(e, generator=g) * 0.1
    w, ids = R.moe_route(logits, bias, k, n_group, topk_group, 2.5, True)
    for i in range(t):
        s = logits[i].sigmoid()
        choice = s + bias
        groups = choice.view(n_group, -1)
        gscore = groups.topk(2, dim=-1)[0].sum(-1)
        keep = set(gscore.topk(topk_group)[1].tolist())
        cand = [x for x in range(e) if x // (e // n_group) in keep]
        want = sorted(sorted(cand, key=lambda x: -float(choice[x]))[:k])
        assert sorted(ids[i].tolist()) == want
        ww = s[ids[i]] / s[ids[i]].sum() * 2.5
        assert torch.allclose(w[i], ww, atol=1e-6)


@pytest.mark.parametrize("fp8", [False, True])
def test_fused_moe_equals_a_per_token_loop_over_its_experts(fp8):
    g = torch.Generator().manual_seed(6)
    t, e, hdim, inter, k = 5, 4, 128, 128, 2
    w13, w2 = torch.randn(e, 2 * inter, hdim, generator=g) * 0.1, torch.randn(e, hdim, inter, generator=g) * 0.1
    s13 = s2 = None
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_block(w13), quantize_fp8_block(w2)
    x = torch.randn(t, hdim, generator=g)
    tw, ids = torch.rand(t, k, generator=g), torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    got = R.fused_moe(x, w13, s13, w2, s2, tw, ids)
    d13 = torch.stack([_blockwise_dequant(w13[i], s13[i]) for i in range(e)]) if fp8 else w13.double()
    d2 = torch.stack([_blockwise_dequant(w2[i], s2[i]) for i in range(e)]) if fp8 else w2.double()
    for i in range(t):
        acc = torch.zeros(hdim, dtype=torch.float64)
        for j in range(k):
            ex = int(ids[i, j])
            gu = d13[ex] @ x[i].double()
            act = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            acc += float(tw[i, j]) * (d2[ex] @ act)
        assert _rel(got[i], acc) < 1e-5


def test_an_absent_experts_pairs_add_nothing_and_are_not_counted_as_touched():
    """Id E = an expert another rank holds (`local_routes`): the pair contributes 0 (as weight 0 would), and
    `count_distinct` does not count it."""
    g = torch.Generator().manual_seed(3)
    t, e, hdim, inter = 4, 3, 64, 32
    w13, w2 = torch.randn(e, 2 * inter, hdim, generator=g), torch.randn(e, hdim, inter, generator=g)
    x, tw = torch.randn(t, hdim, generator=g), torch.rand(t, 2, generator=g)
    ids = torch.tensor([[0, 3], [3, 3], [2, 1], [1, 3]])
    got = R.fused_moe(x, w13, None, w2, None, tw, ids, absent=True)
    here = ids < e
    want = R.fused_moe(x, w13, None, w2, None, tw * here, torch.where(here, ids, 0))  # weight 0 on expert 0
    assert torch.allclose(got, want, atol=1e-5) and got[1].eq(0).all()
    counter = torch.zeros((), dtype=torch.int64)
    R.count_distinct(ids, e, counter)
    assert int(counter) == 3


def test_copy_from_host_copies_and_the_gpu_variant_falls_back_to_it_without_pinned_memory():
    src, dst = torch.arange(10, dtype=torch.int64) * 7, torch.zeros(10, dtype=torch.int64)
    R.copy_from_host(dst, src)
    assert torch.equal(dst, src)
    try:
        from dsaserve.kernels import triton_elementwise as E
    except ImportError:  # the CI's CPU torch may ship no Triton
        return
    dst.zero_()
    E.copy_from_host(dst, src)  # not pinned: the copy itself, no kernel
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="copy_from_host"):
        E.copy_from_host(dst[:3], src)


def test_registry_on_cpu_binds_every_op_to_the_reference(monkeypatch):
    ops = registry.get_ops("cpu")
    for name in registry.OPS:
        assert callable(getattr(ops, name))
        assert ops.impls[name] == "reference"
    assert ops.fp8_linear is R.fp8_linear
    assert ops.graph_safe is False  # the reference fused_moe / indexer_topk sync with the host
    assert registry.describe("cpu")["_fallback_reason"] == "device cpu"


def test_registry_rejects_an_unknown_kernel_choice(set_switch):
    set_switch(registry.ENV_VAR, "fastest")
    with pytest.raises(ValueError, match=registry.ENV_VAR):
        registry.get_ops("cpu")


def test_registry_reference_indexer_k_write_stores_encoded_keys():
    k = torch.randn(3, 32)
    cache = torch.zeros(3, 2 * 36, dtype=torch.uint8)  # 3 pages of 2 slots
    registry.get_ops("cpu").indexer_k_write(cache, "fp8_ds_mla", torch.tensor([4, 1, 2]), k)
    rows = index_pages.read_rows(cache, torch.tensor([4, 1, 2]), "fp8_ds_mla", 32)
    assert _rel(decode_index_k(rows, "fp8_ds_mla"), k) < 5e-2
    assert index_pages.read_rows(cache, torch.tensor([0, 3, 5]), "fp8_ds_mla", 32).eq(0).all()
    # page-major: page 2 holds slot 4's 32 key bytes first, then slot 5's, then their two scales
    assert cache[2, :32].ne(0).any() and cache[2, 32:64].eq(0).all() and cache[2, 64:68].ne(0).any()
