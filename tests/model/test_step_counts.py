"""Per-step byte counters come from the model's structure and the batch's host lengths, in one place: an
eager forward adds exactly `step_counts` (what a CUDA-graph replay adds too), and the structural weight
bytes are the bytes of the projections the forward actually called."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.counters import COUNTERS
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import contiguous_batch
from dsaserve.model.layers.linear import Linear
from dsaserve.model.layers.mla import MLAAttention
from dsaserve.model.layers.moe import Router
from dsaserve.model.step_counts import step_counts


@pytest.fixture(scope="module")
def runner():
    return ModelRunner.from_kwargs("glm-5.3-tiny", num_pages=16)


def _measured(runner, batch) -> dict[str, float]:
    COUNTERS.reset()
    runner.model(batch, runner.kv_pool)
    return {k: v for k, v in COUNTERS.snapshot().items() if k != "moe_experts_touched"}


def test_an_eager_prefill_and_decode_add_the_step_counts(runner):
    prompts, bases = [[5] * 70, [7, 8, 9]], [0, 2 * 64]
    for batch in (contiguous_batch(prompts, [0, 0], bases),
                  contiguous_batch([[1], [2]], [len(p) for p in prompts], bases)):
        expect = step_counts(runner.model.forward_shape(), runner.kv_pool, *batch.host_lens())
        measured = _measured(runner, batch)
        routed = measured.pop("weight_bytes_read") - expect.pop("weight_bytes_read")
        assert measured == expect and routed > 0  # the routed experts are counted by the layers


def test_the_structural_weight_bytes_are_the_projections_a_forward_calls(runner):
    called = []
    hooks = [m.register_forward_hook(lambda m, *_: called.append(m.disk_bytes))
             for m in runner.model.model.layers.modules() if isinstance(m, Linear)]
    try:
        runner.model(contiguous_batch([[3, 4, 5]], [0], [0]), runner.kv_pool)
    finally:
        for h in hooks:
            h.remove()
    main = runner.model.model.layers[: runner.model.cfg.num_hidden_layers]
    absorbed = sum(m.kv_b_proj.disk_bytes for m in main.modules() if isinstance(m, MLAAttention))
    routers = sum(m.weight.numel() * 2 + m.e_score_correction_bias.numel() * 4
                  for m in main.modules() if isinstance(m, Router))
    lm_head = runner.model.lm_head.weight.numel() * 2
    assert runner.model.forward_shape().weight_bytes == sum(called) + absorbed + routers + lm_head


def test_a_forward_within_the_top_k_counts_no_indexer_read_and_no_query_weights(cpu_model):
    """Pages of 4 keys against top-8: a batch two pages wide takes every key (`StepContext.all_keys`), so its
    forward reads no indexer key and no wq_b / weights_proj; one three pages wide scores. The counters say what
    the forward called."""
    from dsaserve.engine.kv_pool import KVPool
    from dsaserve.model.layers.indexer import Indexer

    model = cpu_model("glm-5.3-tiny")
    pool = KVPool(model.cfg, 16, "fp32", model.kv_layer_ids, 4, torch.float32, "cpu")
    shape = model.forward_shape()
    indexers = [m for m in model.modules() if isinstance(m, Indexer)]
    assert shape.query_weight_bytes == sum(ix.wq_b.disk_bytes + ix.weights_proj.disk_bytes for ix in indexers) > 0
    called = []
    hooks = [lin.register_forward_hook(lambda m, *_: called.append(m))
             for ix in indexers for lin in (ix.wq_b, ix.weights_proj)]
    try:
        for batch, every_key in ((contiguous_batch([[3, 4, 5, 6, 7], [9, 10]], [0, 0], [0, 32], 4), True),
                                 (contiguous_batch([[8], [11]], [5, 2], [0, 32], 4), True),
                                 (contiguous_batch([[12, 13, 14]], [6], [0], 4), False)):  # 9 keys: 3 pages
            called.clear()
            COUNTERS.reset()
            model(batch, pool)
            measured = {k: v for k, v in COUNTERS.snapshot().items() if k != "moe_experts_touched"}
            expect = step_counts(shape, pool, *batch.host_lens())
            routed = measured.pop("weight_bytes_read") - expect.pop("weight_bytes_read")
            assert measured == expect and routed > 0
            assert (measured["indexer_bytes_read"] == 0) == every_key == (not called)
            fixed = step_counts(shape, pool, *batch.host_lens())["weight_bytes_read"]
            assert fixed == shape.weight_bytes - (shape.query_weight_bytes if every_key else 0)
            # piecewise segments compute the queries at every width; a wider graph class scores
            segments = step_counts(shape, pool, *batch.host_lens(), segments=True)
            assert segments["weight_bytes_read"] == shape.weight_bytes
            assert segments["indexer_bytes_read"] == expect["indexer_bytes_read"]
            wide = step_counts(shape, pool, *batch.host_lens(), pages=3)
            assert wide["indexer_bytes_read"] > 0 and wide["weight_bytes_read"] == shape.weight_bytes
    finally:
        for h in hooks:
            h.remove()
