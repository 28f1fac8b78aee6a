"""The decode graphs' page-table width classes (engine/decode_graphs.py), on the CPU with stand-in runners: which
widths a model gets, which class a batch replays, the capture order, the shared memory pool and logits buffer. The
replayed logits of each class against the eager step: tests/engine/test_engine_gpu.py."""

from __future__ import annotations

import types

import torch

from dsaserve.engine.decode_graphs import DecodeGraphs, few_row_widths, width_classes


def test_the_narrow_class_is_the_top_ks_width_where_it_is_narrower():
    assert width_classes(3169, 2048, 64, narrow=True) == [32, 3169]  # GLM-5.3 at 202752 tokens
    assert width_classes(3169, 2048, 64, narrow=False) == [3169]  # DP gather graphs, or switched off
    assert width_classes(20, 2048, 64, narrow=True) == [20]  # max_model_len within the top-k
    assert width_classes(32, 2048, 64, narrow=True) == [32]
    assert width_classes(8, 8, 64, narrow=True) == [8]  # a top-k under one page: no class of 0 pages
    assert width_classes(8, None, 64, narrow=True) == [8]  # no indexer


def test_few_row_classes_sit_where_one_rows_fused_selection_doubles_its_chunk():
    """32K and 64K keys (`variants.fused_select_widths`: 128 programs of 256 / 512 keys), strictly between the narrow
    class and max_pages; none without a narrow class or an indexer."""
    assert few_row_widths(3169, 2048, 64, narrow=True) == [512, 1024]  # GLM-5.3 at 202752 tokens
    assert few_row_widths(2049, 2048, 64, narrow=True) == [512, 1024]  # 128K + 64 (bench_gpu's largest context)
    assert few_row_widths(1024, 2048, 64, narrow=True) == [512]  # max_model_len 64K: that class is the widest
    assert few_row_widths(513, 2048, 64, narrow=True) == [512]
    assert few_row_widths(512, 2048, 64, narrow=True) == []
    assert few_row_widths(3169, 2048, 64, narrow=False) == []  # DP gather graphs, or switched off
    assert few_row_widths(3169, None, 64, narrow=True) == []  # no indexer
    assert few_row_widths(12672, 64, 16, narrow=True) == [2048, 4096]  # 16-token pages: the same keys


class _Runner:
    def __init__(self, pages: int, log: list, max_bs: int = 4):
        self.pages, self.log, self.pool_handle, self.logits_out = pages, log, None, None
        self.max_bs, self.buckets, self.graphs, self.copy_in_graph = max_bs, [1, 2, 4][:max_bs], {1: "g"}, True
        self.capture_seconds, self.capture_retries = 1.5, pages % 2

    def capture(self, warm_each=True):
        self.log.append(("capture", self.pages, self.pool_handle, self.logits_out, warm_each))
        self.pool_handle = self.pool_handle or f"pool-{self.pages}"
        self.logits_out = self.logits_out or f"logits-{self.pages}"
        return [1, 2, 4]

    def fallback_reason(self, batch, bucket=None):
        return None if batch.page_table.shape[1] <= self.pages else "context_over_capture"

    def replay(self, batch, bucket=None):
        self.log.append(("replay", self.pages, bucket))
        return self.pages


def _batch(width: int, rows: int = 3):
    return types.SimpleNamespace(page_table=torch.zeros(rows, width, dtype=torch.int64))


def test_a_batch_replays_the_narrowest_class_that_holds_its_page_table():
    log: list = []
    g = DecodeGraphs(lambda pages: _Runner(pages, log), [100, 32])
    assert g.widths == [32, 100] and g.max_bs == 4 and g.graphs == {1: "g"} and g.copy_in_graph
    assert g.replay(_batch(1)) == 32 and g.replay(_batch(32), 2) == 32
    assert g.replay(_batch(33)) == 100 and g.replay(_batch(100)) == 100
    assert g.fallback_reason(_batch(101)) == "context_over_capture"  # the widest says why
    assert log == [("replay", 32, None), ("replay", 32, 2), ("replay", 100, None), ("replay", 100, None)]


def test_the_widest_class_captures_first_and_the_others_into_its_pool():
    """...and into its logits buffer (one for every class: a replay's logits are read before the next replay)."""
    log: list = []
    g = DecodeGraphs(lambda pages: _Runner(pages, log), [32, 100, 8])
    assert g.capture(warm_each=True) == [1, 2, 4]
    assert log == [("capture", 100, None, None, True), ("capture", 32, "pool-100", "logits-100", False),
                   ("capture", 8, "pool-100", "logits-100", False)]
    assert g.capture_seconds == 4.5 and g.capture_retries == 0


def test_batches_of_few_rows_also_replay_the_few_row_classes():
    """A few-row class holds batches of at most its rows (and a DP-agreed bucket within them); larger batches, or
    ones wider than it, replay the full classes as before. It captures after the full classes, into their pool."""
    log: list = []
    g = DecodeGraphs(lambda pages, max_bs=None: _Runner(pages, log, max_bs or 4), [32, 3169], [512, 1024], few_rows=2)
    assert g.widths == [32, 3169] and g.few_row_widths == [512, 1024] and g.max_bs == 4
    assert g.replay(_batch(513, rows=1)) == 1024 and g.replay(_batch(300, rows=2)) == 512
    assert g.replay(_batch(20, rows=1)) == 32  # the narrow class is narrower still
    assert g.replay(_batch(513, rows=3)) == 3169 and g.replay(_batch(1025, rows=1)) == 3169
    assert g.replay(_batch(300, rows=1), 4) == 3169  # a bucket past the few rows
    g.capture()
    assert [e[1] for e in log if e[0] == "capture"] == [3169, 32, 512, 1024]
    assert all(e[2] == "pool-3169" for e in log if e[0] == "capture" and e[1] != 3169)
    assert g.capture_seconds == 6.0 and g.capture_retries == 1  # every class counted (3169: one retry)
