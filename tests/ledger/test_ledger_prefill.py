"""Chunked prefill: closed forms against brute force, additivity, and the quadratic indexer term."""

from __future__ import annotations

import pytest

from dsaserve.config import load_config
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.prefill import keys_scored, topk_selected


@pytest.mark.parametrize("prefix, n", [(0, 1), (0, 7), (5, 3), (100, 50), (3000, 10)])
def test_keys_scored_and_topk_selected_match_brute_force(prefix: int, n: int):
    positions = range(prefix, prefix + n)
    assert keys_scored(prefix, n) == sum(p + 1 for p in positions)
    for topk in (1, 8, 64, 2048):
        assert topk_selected(prefix, n, topk) == sum(min(topk, p + 1) for p in positions)


def _li(**work) -> LedgerInputs:
    return LedgerInputs(load_config("glm-5.3"), Deployment(tp=8), PRESETS["h200"], Workload(**work), Assumptions())


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


def test_q_tile_divides_the_indexer_read():
    a = _li(context=65536).prefill().total("indexer_read")
    li = LedgerInputs(load_config("glm-5.3"), Deployment(tp=8), PRESETS["h200"], Workload(context=65536),
                      Assumptions(indexer_q_tile=1))
    assert li.prefill().total("indexer_read") == pytest.approx(32 * a)
