"""DP-attention's per-step agreement (engine/dp_step.py) without ranks: the rule that picks the padded gather or
the all-to-all exchange, and padding a batch — its rows must not change the real rows' logits, must write only
the sink page, and must not count as traffic."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.counters import COUNTERS
from dsaserve.engine.cuda_graph_runner import decode_buckets
from dsaserve.engine.dp_step import DPStep, choose_dp_step, empty_batch, pad_batch
from dsaserve.engine.kv_pool import KVPool
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import contiguous_batch

BUCKETS = decode_buckets(16)  # 1, 2, 4, 8, 16


@pytest.mark.parametrize("tokens, decode, policy, want", [
    ((3, 1), (True, True), "auto", DPStep("gather", 4, (3, 1))),  # uneven: both padded to the bucket of 3
    ((0, 5), (True, True), "auto", DPStep("gather", 8, (0, 5))),  # an idle rank pads 8 rows of nothing
    ((2, 0), (True, False), "auto", DPStep("gather", 2, (2, 0))),  # an idle rank's decode flag does not matter
    ((16, 1), (True, True), "auto", DPStep("gather", 16, (16, 1))),  # the largest bucket
    ((17, 1), (True, True), "auto", DPStep("a2a", 0, (17, 1))),  # past it: no graph to win
    ((40, 1), (False, True), "auto", DPStep("a2a", 0, (40, 1))),  # a prefill anywhere: exchange
    ((40, 1), (False, True), "gather", DPStep("gather", 40, (40, 1))),  # forced: pad to the busiest, eager
    ((3, 1), (True, True), "a2a", DPStep("a2a", 0, (3, 1))),
    ((0, 0), (True, True), "auto", DPStep("skip", 0, (0, 0))),  # nobody has a token: no forward
])
def test_the_rule_picks_gather_for_graph_sized_decodes_and_the_exchange_otherwise(tokens, decode, policy, want):
    assert choose_dp_step(tokens, decode, BUCKETS, policy) == want


def test_pad_batch_appends_one_token_padding_requests_into_the_sink_page():
    batch = contiguous_batch([[5], [6]], [70, 3], [0, 256])
    padded = pad_batch(batch, 4, sink_page=9)
    assert padded.moe_gather and padded.num_padding == 2 and padded.num_tokens == 4
    assert padded.input_ids.tolist() == [5, 6, 0, 0] and padded.positions.tolist() == [70, 3, 0, 0]
    assert padded.req_index.tolist() == [0, 1, 2, 3] and padded.seq_lens_cpu == [71, 4, 1, 1]
    assert padded.out_cache_loc.tolist()[2:] == [9 * 64] * 2 and (padded.page_table[2:] == 9).all()
    assert padded.logits_indices.tolist() == batch.logits_indices.tolist()  # only the real rows sample
    idle = pad_batch(empty_batch(64), 2, sink_page=9)
    assert idle.num_padding == 2 and idle.logits_indices.numel() == 0 and idle.page_table.shape == (2, 1)
    with pytest.raises(ValueError, match="more than the agreed 1"):
        pad_batch(batch, 1, sink_page=9)
    with pytest.raises(ValueError, match="no sink page"):
        pad_batch(batch, 4, sink_page=-1)


def _counts(before: dict) -> dict:
    keep = ("forward_steps", "kv_bytes", "indexer_bytes")
    return {k: v for k, v in COUNTERS.diff(COUNTERS.snapshot(), before).items() if k.startswith(keep)}


def test_padding_rows_change_neither_the_real_rows_nor_other_pages_nor_the_traffic():
    runner = ModelRunner.from_kwargs("glm-5.3-tiny", kv_layout="fp32", num_pages=16)
    model, cfg = runner.model, runner.cfg
    pool = KVPool(cfg, 16, "fp32", model.kv_layer_ids, 64, runner.dtype, "cpu", sink_pages=1)
    prompts = [[3 + i % 50 for i in range(70)], [9 + i % 40 for i in range(20)]]
    model(contiguous_batch(prompts, [0, 0], [0, 256]), pool)
    decode = contiguous_batch([[11], [12]], [70, 20], [0, 256])
    before = COUNTERS.snapshot()
    want, _ = model(decode, pool)
    plain = _counts(before)
    kv, idx = pool.kv_buffer.clone(), pool.index_buffer.clone()
    before = COUNTERS.snapshot()
    got, _ = model(pad_batch(decode, 4, pool.sink_page), pool)
    assert _counts(before) == plain  # the padding is not traffic
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # only the sink page, and the real rows' own slots (rewritten, equal up to rounding: 4 rows, not 2)
    allowed = set(range(pool.sink_page * 64, (pool.sink_page + 1) * 64)) | set(decode.out_cache_loc.tolist())
    for new, old in ((pool.kv_buffer, kv), (pool.index_buffer, idx)):
        changed = set((new != old).any(dim=2).any(dim=0).nonzero().flatten().tolist())
        assert changed and changed <= allowed and changed & {pool.sink_page * 64}
