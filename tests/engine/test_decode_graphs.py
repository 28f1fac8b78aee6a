"""The decode graphs' page-table width classes (engine/decode_graphs.py), on the CPU with stand-in runners: which
widths a model gets, which class a batch replays, the capture order, the shared memory pool and logits buffer. The
replayed logits of each class against the eager step: tests/engine/test_engine_gpu.py."""

from __future__ import annotations

import types

import torch

from dsaserve.engine.decode_graphs import DecodeGraphs, width_classes


def test_the_narrow_class_is_the_top_ks_width_where_it_is_narrower():
    assert width_classes(3169, 2048, 64, narrow=True) == [32, 3169]  # GLM-5.3 at 202752 tokens
    assert width_classes(3169, 2048, 64, narrow=False) == [3169]  # DP gather graphs, or switched off
    assert width_classes(20, 2048, 64, narrow=True) == [20]  # max_model_len within the top-k
    assert width_classes(32, 2048, 64, narrow=True) == [32]
    assert width_classes(8, 8, 64, narrow=True) == [8]  # a top-k under one page: no class of 0 pages
    assert width_classes(8, None, 64, narrow=True) == [8]  # no indexer


class _Runner:
    def __init__(self, pages: int, log: list):
        self.pages, self.log, self.pool_handle, self.logits_out = pages, log, None, None
        self.max_bs, self.buckets, self.graphs, self.copy_in_graph = 4, [1, 2, 4], {1: "g"}, True
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


def _batch(width: int):
    return types.SimpleNamespace(page_table=torch.zeros(3, width, dtype=torch.int64))


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
