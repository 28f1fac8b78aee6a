"""The startup dummies (`engine/memory_profile.py`) stay inside what a real batch may hold."""

from __future__ import annotations

import pytest
import torch

from dsaserve.config import load_config
from dsaserve.engine.memory_profile import CompileCache, dummy_decode, dummy_prefill, unscored_query_bytes


@pytest.mark.parametrize("tokens,max_len", [(2304, 2048), (2048, 2048), (130, 100), (70, None)])
def test_dummy_prefill_keeps_positions_inside_the_rope_table_and_its_pages(tokens, max_len):
    """eval's 2304-token budget on glm-5.3-mini (2048 positions): the GPU path's RoPE table has one row per
    position, so a position past it was an out-of-range gather (a device-side assert at warmup)."""
    b = dummy_prefill(tokens, 64, 100, "cpu", max_len)
    assert b.num_tokens == tokens
    assert int(b.positions.max()) < (max_len or tokens)
    assert b.out_cache_loc.unique().numel() == tokens  # one slot per token
    assert int(b.out_cache_loc.max()) < -(-tokens // 64) * 64  # within the pages one request would take


def test_a_dummy_prefill_within_the_top_k_adds_the_queries_it_did_not_make():
    """glm-5.3-mini selects top-64: a 64-token dummy takes every key and makes no indexer queries, which a 64-token
    chunk after a cached prefix does: q [64, 16 heads, 64] bf16 + fp32 head weights [64, 16]."""
    cfg = load_config("glm-5.3-mini")
    assert unscored_query_bytes(cfg, dummy_prefill(64, 64, 100, "cpu"), torch.bfloat16) == 64 * 16 * (64 * 2 + 4)
    assert unscored_query_bytes(cfg, dummy_prefill(65, 64, 100, "cpu"), torch.bfloat16) == 0  # scored: measured
    # past max_len the dummy is requests of max_len: each within the top-k, though the chunk is not
    assert unscored_query_bytes(cfg, dummy_prefill(130, 64, 100, "cpu", 64), torch.float32) == 130 * 16 * (64 * 4 + 4)


def test_dummy_decode_rows_decode_their_own_tokens_unless_asked_for_token_1():
    """A serving batch's requests decode different tokens, so the routers spread them over the experts: the
    benchmarks' batch-128 rows touched 36 of 96 experts with token 1 in every row, 96 with their own tokens."""
    b = dummy_decode(128, 1000, 64, "cpu", vocab_size=5000)
    ids = b.input_ids.tolist()
    assert len(set(ids)) > 100 and all(1 <= t < 5000 for t in ids)
    assert ids == dummy_decode(128, 1000, 64, "cpu", vocab_size=5000).input_ids.tolist()  # seeded: runs compare
    assert b.positions.tolist() == [1000] * 128
    assert dummy_decode(128, 1000, 64, "cpu").input_ids.tolist() == [1] * 128
    pages = -(-1001 // 64)  # each request's slots in its own page range
    assert [int(s) // (64 * pages) for s in b.out_cache_loc] == list(range(128))


def test_compile_cache_accepts_a_triton_cache_dir_that_does_not_exist_yet(tmp_path, monkeypatch, caplog):
    """A user's TRITON_CACHE_DIR that Triton has not made yet (an empty cache, the cold start) is no error:
    nothing was there before, and kernels written there later count as compiled by this start."""
    triton_dir = tmp_path / "fresh" / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(triton_dir))
    cache = CompileCache(tmp_path / "dsaserve")
    assert cache.before == set()
    (triton_dir / "kernel_a").mkdir(parents=True)
    assert cache.report()["status"] == "miss"
    cache.mark_up()
    (triton_dir / "kernel_b").mkdir()
    (triton_dir / "kernel_b" / "__grp___sparse_mla_kernel.json").write_text("{}")
    (triton_dir / "kernel_b" / "_sparse_mla_kernel.json").write_text("{}")
    with caplog.at_level("WARNING"):
        assert cache.compiles_after_up()["kernel_compiles_after_up"] == 1
        assert cache.compiles_after_up()["kernel_compiles_after_up"] == 1  # counted again, logged once
    assert [r.getMessage() for r in caplog.records].count(
        "Triton kernel _sparse_mla_kernel compiled after Up: a shape the warmup did not cover (kernel_b)") == 1
