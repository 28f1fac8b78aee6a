"""Chunked prefill: closed forms against brute force, additivity, the quadratic indexer term, and the prefill
staging (which chunks the engine's rule stages, what they move, what enters the HBM time)."""

from __future__ import annotations

import pytest

from dsaserve.config import load_config
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.prefill import keys_scored, topk_selected
from dsaserve.ledger.sections_prefill import prefill_totals

LAYERS = 78  # GLM-5.3's KV layers
FP8_DS_MLA, BF16_ROW = 656, 1152  # the cache's row; a staged row (512 + 64 as bf16)


@pytest.mark.parametrize("prefix, n", [(0, 1), (0, 7), (5, 3), (100, 50), (3000, 10)])
def test_keys_scored_and_topk_selected_match_brute_force(prefix: int, n: int):
    positions = range(prefix, prefix + n)
    assert keys_scored(prefix, n) == sum(p + 1 for p in positions)
    for topk in (1, 8, 64, 2048):
        assert topk_selected(prefix, n, topk) == sum(min(topk, p + 1) for p in positions)


def _li(asm: Assumptions | None = None, **work) -> LedgerInputs:
    return LedgerInputs(load_config("glm-5.3"), Deployment(tp=8), PRESETS["h200"], Workload(**work),
                        asm or Assumptions())


def test_chunks_add_up_to_the_whole_prompt_and_later_chunks_cost_more():
    p = _li(context=100_000, chunk=8192).prefill()
    assert sum(c.tokens for c in p.chunks) == 100_000 and len(p.chunks) == 13
    assert p.chunks[-1].tokens == 100_000 - 12 * 8192
    full = [c for c in p.chunks if c.tokens == 8192]
    assert [c.indexer_flops for c in full] == sorted(c.indexer_flops for c in full)
    assert full[-1].lower_bound_s > full[0].lower_bound_s
    pairs = sum(keys_scored(c.prefix, c.tokens) for c in p.chunks)
    assert pairs == keys_scored(0, 100_000)


def test_cross_chunk_share_is_one_minus_one_over_chunks_for_equal_chunks():
    p = _li(context=2**20, chunk=32768).prefill()
    assert p.cross_chunk_share == pytest.approx(1 - 32 * keys_scored(0, 32768) / keys_scored(0, 2**20))


def test_prefix_hit_start_skips_the_cached_tokens_but_scores_them():
    li = _li(context=20_000, chunk=32768)
    warm = li.prefill(20_000, start=18_944)
    assert [(c.prefix, c.tokens) for c in warm.chunks] == [(18_944, 1_056)]
    assert warm.chunks[0].indexer_flops == 2 * 32 * 128 * 21 * keys_scored(18_944, 1_056)
    with pytest.raises(ValueError, match="prefill start"):
        li.prefill(20_000, start=20_000)


def test_a_chunk_within_the_top_k_scores_no_key():
    """A first chunk of 2048 tokens holds at most GLM-5.3's top-2048 keys a row: every key taken, no indexer work;
    the next chunk scores its queries against every earlier key."""
    p = _li(context=4096, chunk=2048).prefill()
    first, second = p.chunks
    assert first.indexer_flops == first.indexer_read == 0
    assert second.indexer_flops == 2 * 32 * 128 * 21 * keys_scored(2048, 2048)
    assert _li(context=2049, chunk=4096).prefill().chunks[0].indexer_flops == 2 * 32 * 128 * 21 * keys_scored(0, 2049)


def test_a_chunk_within_the_top_k_makes_no_indexer_queries():
    """Its 21 full layers skip wq_b (q latent -> 32 heads x 128) and weights_proj (hidden -> 32): the first chunk's
    GEMM FLOPs are the second's less those, token for token (neither is the last, which adds the lm_head)."""
    cfg = load_config("glm-5.3")
    first, second, _ = _li(context=6144, chunk=2048).prefill().chunks
    queries = 2 * 21 * (cfg.q_lora_rank * 32 * 128 + cfg.hidden_size * 32)
    assert second.gemm_flops - first.gemm_flops == queries * 2048


def test_a_chunk_within_the_top_k_reads_no_query_weights(monkeypatch):
    """The same first chunk with the within-top-k rule off: it reads wq_b + weights_proj again (the indexer is
    replicated across TP8: 21 x 8.8 MB on every GPU), and multiplies through them."""
    import dsaserve.ledger.prefill as P

    li = _li(context=2048, chunk=2048)
    within = li.prefill().chunks[0]
    monkeypatch.setattr(P, "keys_within_topk", lambda *a: False)
    scored = li.prefill().chunks[0]
    per_gpu = li.inv.query_bytes["indexer"]
    assert per_gpu == pytest.approx(21 * 8.8e6, rel=0.01)
    assert (scored.memory_s - within.memory_s) * li.hw.hbm_bw == pytest.approx(
        per_gpu + scored.indexer_read / 8, rel=1e-9)  # and the indexer keys it now scores
    assert scored.gemm_flops > within.gemm_flops


def test_q_tile_divides_the_indexer_read():
    a = _li(context=65536).prefill().total("indexer_read")
    li = LedgerInputs(load_config("glm-5.3"), Deployment(tp=8), PRESETS["h200"], Workload(context=65536),
                      Assumptions(indexer_q_tile=1))
    assert li.prefill().total("indexer_read") == pytest.approx(32 * a)


def test_chunks_the_engine_stages_pay_the_staging_and_gather_bf16_rows():
    """1M in 32K chunks: a chunk is staged while its request's pages hold <= 8 rows a token (chunks 0-7, up to
    262,144 rows over 32,768 tokens). Staged, every row of its pages is read at 656 B and written at 1152 B once a
    layer, and sparse MLA gathers 1152 B rows; the other chunks gather the cache's 656 B rows."""
    p = _li().prefill()
    assert [c.staged for c in p.chunks] == [True] * 8 + [False] * 24
    for c in p.chunks:
        slots = topk_selected(c.prefix, c.tokens, 2048)
        assert c.kv_staged == (c.prefix + c.tokens if c.staged else 0) * (FP8_DS_MLA + BF16_ROW) * LAYERS
        assert c.kv_read == slots * (BF16_ROW if c.staged else FP8_DS_MLA) * LAYERS
    assert p.chunks[7].kv_staged == 262_144 * 1808 * 78  # 36.97 GB


def test_small_chunks_and_long_contexts_read_the_cache_themselves():
    li = _li(context=20_000, chunk=32768)
    assert li.prefill(20_000).chunks[0].kv_staged == 313 * 64 * 1808 * LAYERS  # whole pages: 313 for 20,000 tokens
    assert li.prefill(20_000, start=18_944).chunks[0].kv_staged == 0  # 1,056 tokens over 313 pages: 19 rows a token
    assert _li(context=511).prefill().chunks[0].kv_staged == 0  # under 512 tokens
    assert _li(context=512).prefill().chunks[0].kv_staged > 0


@pytest.mark.parametrize("layout, row", [("bf16", 1152), ("fp8_e4m3", 576), ("nvfp4_ds_mla", 352)])
def test_only_fp8_ds_mla_is_staged(layout: str, row: int):
    c = _li(context=32768, kv_layout=layout).prefill().chunks[0]
    assert c.kv_staged == 0 and c.kv_read == topk_selected(0, 32768, 2048) * row * LAYERS


def test_the_staging_and_the_gather_enter_the_hbm_time():
    """Default: the staging's traffic, and the gather reading each context row once a layer (now as bf16).
    prefill_kv_gather=slots: every selected slot from HBM."""
    hbm = PRESETS["h200"].hbm_bw
    on = _li(context=65536).prefill().chunks
    off = _li(Assumptions(prefill_staging=False), context=65536).prefill().chunks
    every_slot = _li(Assumptions(prefill_kv_gather="slots"), context=65536).prefill().chunks
    for a, b, s in zip(on, off, every_slot, strict=True):
        rows = a.prefix + a.tokens
        assert a.staged and not b.staged
        assert a.memory_s - b.memory_s == pytest.approx((a.kv_staged + rows * (BF16_ROW - FP8_DS_MLA) * LAYERS) / hbm)
        slots = topk_selected(a.prefix, a.tokens, 2048)
        assert s.memory_s - a.memory_s == pytest.approx((slots - rows) * BF16_ROW * LAYERS / hbm)


def test_prefill_totals_itemise_the_gather_and_the_staging():
    li = _li()
    p = li.prefill()
    rows = {r["quantity"]: r for r in prefill_totals(li, p).rows}
    assert rows["prefill staging"]["value"] == p.total("kv_staged") > 0
    assert rows["prefill staging"]["why"].startswith("8 of 32 chunks")
    assert rows["sparse-MLA KV gathered"]["value"] == p.total("kv_read")
    off = _li(Assumptions().with_updates({"prefill_staging": "false"}))
    rows = {r["quantity"]: r for r in prefill_totals(off, off.prefill()).rows}
    assert rows["prefill staging"]["value"] == 0 and "prefill_staging=false" in rows["prefill staging"]["why"]
