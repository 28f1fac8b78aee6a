"""Which selection decode's long rows take (`triton_indexer_dispatch._long_rows`), on the CPU: the kernels are stubbed,
so only the routing is tested (the kernels' own tests run on the device). 1-2 rows over the FP8 cache take scores
and select in one cooperative launch up to `variants.FUSED_MAX_CHUNK`-key chunks; past that, over the plain
layouts, or with the fused launch switched off, the score kernel then the cooperative select; with the cooperative
launches off (the interpreter's setting), the select's launches. Also the fused chunk's rule (`variants`)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dsaserve.common.kv_layout import get_kv_layout  # noqa: E402
from dsaserve.kernels import (  # noqa: E402
    triton_indexer,
    triton_indexer_coop,
    triton_indexer_dispatch,
    triton_indexer_long,
)
from dsaserve.kernels.variants import (  # noqa: E402
    FUSED_MAX_CHUNK,
    FUSED_PROGRAMS,
    SELECT_CHUNK,
    fused_select_chunk,
    selection_class,
)

PS, TOPK = 64, 2048


@pytest.fixture
def calls(monkeypatch):
    seen = []
    for mod, name in ((triton_indexer_coop, "coop_score_select"), (triton_indexer_coop, "coop_select"),
                      (triton_indexer_long, "long_row_select")):
        monkeypatch.setattr(mod, name, lambda *a, _n=name, **kw: seen.append(_n))
    monkeypatch.setattr(triton_indexer, "index_scores",
                        lambda q, *a, **kw: seen.append("index_scores") or torch.empty(q.shape[0], 1))
    monkeypatch.setattr(triton_indexer_coop, "COOP_ROWS", 2)  # as on a GPU (the interpreter sets 0)
    monkeypatch.setattr(triton_indexer_coop, "FUSED_ROWS", 2)
    return seen


def _route(rows: int, keys: int, layout: str = "fp8_ds_mla") -> None:
    q, w = torch.zeros(rows, 32, 128), torch.zeros(rows, 32)
    table = torch.zeros(rows, keys // PS, dtype=torch.int64)
    req, pos = torch.arange(rows), torch.full((rows,), keys - 1)
    triton_indexer_dispatch._long_rows(q, w, torch.empty(0), get_kv_layout(layout), table, req, pos, TOPK, PS)


@pytest.mark.parametrize("rows,keys,want", [
    (1, 32768, ["coop_score_select"]), (1, 65536, ["coop_score_select"]), (2, 32768, ["coop_score_select"]),
    (1, 131072, ["index_scores", "coop_select"]), (2, 65536, ["index_scores", "coop_select"]),
    (2, 131072, ["index_scores", "coop_select"])])
def test_a_few_rows_over_the_fp8_cache_fuse_up_to_the_largest_chunk(calls, rows, keys, want):
    _route(rows, keys)
    assert calls == want


def test_plain_layouts_and_the_switches_keep_the_launches_apart(calls, monkeypatch):
    _route(1, 32768, "bf16")
    assert calls == ["index_scores", "coop_select"]
    calls.clear()
    monkeypatch.setattr(triton_indexer_coop, "FUSED_ROWS", 0)  # profile_decode's "score_apart"
    _route(1, 32768)
    assert calls == ["index_scores", "coop_select"]
    calls.clear()
    monkeypatch.setattr(triton_indexer_coop, "FUSED_ROWS", 2)
    monkeypatch.setattr(triton_indexer_coop, "COOP_ROWS", 0)  # "select_launches": implies the scores apart too
    _route(1, 32768)
    assert calls == ["index_scores", "long_row_select"]


def test_the_fused_chunk_spreads_a_few_rows_over_the_launch_and_stays_a_power_of_two():
    for rows in (1, 2):
        for keys in (16448, 32768, 65536, 131072, 202752):
            chunk = fused_select_chunk(rows, keys)
            assert chunk & (chunk - 1) == 0 and 256 <= chunk <= SELECT_CHUNK
            assert rows * -(-keys // chunk) <= FUSED_PROGRAMS
            assert chunk == 256 or rows * -(-keys // (chunk // 2)) > FUSED_PROGRAMS  # the smallest that fits
    assert fused_select_chunk(1, 32768) == 256 and fused_select_chunk(1, 131072) == 1024


def test_the_selection_class_names_the_fused_chunk_only_where_decode_takes_it():
    assert selection_class(1, 512, PS, TOPK)[3] == 256  # 32K keys: fused
    assert selection_class(2, 1024, PS, TOPK)[3] == 0  # 2 x 64K: 1024-key chunks, past FUSED_MAX_CHUNK
    assert fused_select_chunk(2, 65536) > FUSED_MAX_CHUNK
    # two rows at 64K keys and at 70K then meet in one class: the same compiled select (scores, then 2048-key chunks)
    assert selection_class(2, 1024, PS, TOPK) == selection_class(2, 1100, PS, TOPK)


def test_decode_long_rows_leave_the_scores_past_each_position_unwritten(monkeypatch):
    """3+ decode rows at a wide page table: the score kernel is asked not to fill the keys past each row's position
    with -inf (`fill=False`): the split select reads none of them, and at a 128K-wide table a 32K row's fill was
    three quarters of its score row (bench/RESULTS.md, forty-fifth session)."""
    seen: dict = {}
    monkeypatch.setattr(triton_indexer, "index_scores",
                        lambda q, *a, **kw: seen.update(kw) or torch.empty(q.shape[0], 1))
    monkeypatch.setattr(triton_indexer_long, "long_row_select", lambda *a, **kw: seen.update(select=True))
    _route(8, 131072)
    assert seen["fill"] is False and seen["skip_below"] == TOPK and seen["select"]


def test_a_chunk_past_the_cooperative_kernels_limit_takes_the_launches_and_a_direct_call_is_refused(monkeypatch):
    """A chunk's two counts share one int32 sum in the cooperative kernels (`COOP_CHUNK_LIMIT`), while the launches
    take chunks up to 32768 keys: such a chunk is routed to the launches, and a cooperative call with it fails by
    name before any compile (not at the kernel's static_assert)."""
    monkeypatch.setattr(triton_indexer_coop, "COOP_ROWS", 2)
    limit = triton_indexer_coop.COOP_CHUNK_LIMIT.value
    scores = torch.zeros(1, 2 * limit)
    assert triton_indexer_coop.cooperative(1, 2 * limit, limit // 2, scores)
    assert not triton_indexer_coop.cooperative(1, 2 * limit, limit, scores)
    with pytest.raises(ValueError, match=f"coop_select: chunk {limit} is not below {limit}"):
        triton_indexer_coop._launch_workspace(scores, limit, "coop_select")
