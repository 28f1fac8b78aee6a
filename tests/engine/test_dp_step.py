"""DP-attention's per-step agreement (engine/dp_step.py) without ranks: the rule that picks a graph gather step,
an eager gather step or the all-to-all exchange from every rank's (tokens, decode-only)."""

from __future__ import annotations

import pytest

from dsaserve.engine.cuda_graph_runner import decode_buckets
from dsaserve.engine.dp_step import DPStep, choose_dp_step, empty_batch

BUCKETS = decode_buckets(16)  # 1, 2, 4, 8, 16
BUDGET = 256  # max_gather_rows: 2 ranks x max(chunked_prefill_size, max_num_batched_tokens) = 128, as profiled


@pytest.mark.parametrize("tokens, decode, policy, want", [
    ((3, 1), (True, True), "auto", DPStep("gather", 4, (3, 1), graph=True)),  # uneven: the bucket of 3
    ((0, 5), (True, True), "auto", DPStep("gather", 8, (0, 5), graph=True)),  # an idle rank replays padding
    ((2, 0), (True, False), "auto", DPStep("gather", 2, (2, 0), graph=True)),  # an idle rank's flag: no matter
    ((16, 1), (True, True), "auto", DPStep("gather", 16, (16, 1), graph=True)),  # the largest bucket
    ((17, 1), (True, True), "auto", DPStep("gather", 17, (17, 1))),  # past it: eager, padded to the busiest
    ((100, 3), (False, True), "auto", DPStep("gather", 100, (100, 3))),  # a prefill: eager, 2 x 100 <= 256
    ((129, 3), (False, True), "auto", DPStep("a2a", 0, (129, 3))),  # 2 x 129 rows past the profiled step
    ((129, 3), (False, True), "gather", DPStep("gather", 129, (129, 3))),  # forced
    ((3, 1), (True, True), "a2a", DPStep("a2a", 0, (3, 1))),  # forced
    ((0, 0), (True, True), "auto", DPStep("skip", 0, (0, 0))),  # nobody has a token: no forward
])
def test_the_rule_prefers_graphs_then_eager_gathers_within_the_profiled_step(tokens, decode, policy, want):
    assert choose_dp_step(tokens, decode, BUCKETS, BUDGET, policy) == want


def test_an_idle_ranks_batch_has_no_requests():
    idle = empty_batch(64)
    assert idle.num_tokens == idle.batch_size == 0 and idle.host_lens() == ([], [])
    assert idle.page_table.shape == (0, 1) and idle.dp_rows == 0
