"""Per-step byte counters come from the model's structure and the batch's host lengths, in one place: an
eager forward adds exactly `step_counts` (what a CUDA-graph replay adds too), and the structural weight
bytes are the bytes of the projections the forward actually called."""

from __future__ import annotations

import pytest

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
