"""What warmup covers (engine/warmup_plan.py, engine/warmup.py) against what the scheduler can form, checked
without a GPU: every step's token count and row count has a graph bucket, every attention-core shape falls
in a warmed variant class, every sampler code path has a variant; and the warm functions run what the plan
lists without touching any request's KV. (The GPU test that no kernel compiles after Up under a mixed
workload: tests/engine/test_piecewise_gpu.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.warmup_plan import (
    PIECEWISE_MAX_TOKENS,
    SAMPLER_VARIANTS,
    WarmupPlan,
    bucket_for,
    decode_buckets,
    parse_buckets,
    piecewise_buckets,
)
from dsaserve.kernels.variants import CORE_WIDTH_ALIGN, SELECT_MAX_ROWS, core_width

# (max_num_batched_tokens, max_running_requests, max pages per request, index_topk): GLM-5.3 served with the
# defaults (202752-token context), a long-chunk deployment, the tiny test config, a 70K-token context (its two-row
# selection classes: the fused launch's chunk limit falls inside it)
CONFIGS = [(2048, 128, 3168, 2048), (8192, 256, 3168, 2048), (512, 16, 64, 8), (2048, 128, 1100, 2048)]


@pytest.mark.parametrize("max_tokens,max_rows,max_pages,topk", CONFIGS)
def test_every_step_the_scheduler_can_form_has_a_warmed_bucket(max_tokens, max_rows, max_pages, topk):
    args = EngineArgs(max_num_batched_tokens=max_tokens, max_running_requests=max_rows)
    plan = WarmupPlan.build(args.graph_max_bs, args.piecewise_tokens, max_pages, 64, topk)
    # larger steps run eagerly by design (counted eager_large_steps; piecewise_buckets says why)
    assert plan.piecewise[-1] == min(max_tokens, PIECEWISE_MAX_TOKENS)
    for tokens in range(1, plan.piecewise[-1] + 1):
        b = bucket_for(tokens, plan.piecewise)
        assert b is not None and b - tokens < max(64, b // 4)  # padding: < 64 rows, or a quarter past 512
    assert all(bucket_for(bs, plan.decode) is not None for bs in range(1, max_rows + 1))


@pytest.mark.parametrize("max_tokens,max_rows,max_pages,topk", CONFIGS)
def test_every_attention_core_shape_falls_in_a_warmed_variant_class(max_tokens, max_rows, max_pages, topk):
    """The core runs on a step's own rows (1..max_tokens) and page-table width (1..max_pages): both parts of
    its variant class (sparse MLA by rows, the indexer selection by rows x width) were warmed."""
    plan = WarmupPlan.build(max_rows, piecewise_buckets(max_tokens), max_pages, 64, topk)
    warmed = plan.warmed_core_classes()
    widths = sorted({core_width(p) for p in range(1, max_pages + 1)})
    for rows in range(1, max_tokens + 1):
        for pages in widths:
            mla, select = plan.core_class(rows, pages)
            assert mla in warmed and select in warmed, (rows, pages)
    assert all(rows <= max_tokens and pages <= core_width(max_pages) for rows, pages in plan.core_shapes)


def test_the_core_classes_separate_what_the_kernels_compile_separately():
    plan = WarmupPlan.build(8, [2048], 3168, 64, 2048)
    assert plan.core_class(1, 1)[1] == ("all_visible",)  # 16 pages = 1024 keys <= top-k: take_all, no scores
    assert plan.core_class(1, 48)[1] != plan.core_class(1, 80)[1]  # 4096- vs 8192-key selection blocks
    assert plan.core_class(1, 3000)[1] != plan.core_class(3, 3000)[1]  # warps of the chunked selection
    assert plan.core_class(SELECT_MAX_ROWS + 1, 80)[1] == ("prefill", False)  # the prefill kernel's token count:
    assert plan.core_class(SELECT_MAX_ROWS + 15, 80)[1] != plan.core_class(SELECT_MAX_ROWS + 16, 80)[1]  # % 16
    assert plan.core_class(5, 48)[0] != plan.core_class(6, 48)[0]  # sparse MLA splits vary with rows
    assert core_width(17) == 2 * CORE_WIDTH_ALIGN


def test_every_sampler_code_path_has_a_warmed_variant():
    """model/sampler.py branches on these fields; each is set off its default by some variant."""
    branching = {"temperature", "top_k", "top_p", "min_p", "seed", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "logprobs", "min_tokens", "structured_outputs"}
    default = SamplingParams()
    touched = {k for v in SAMPLER_VARIANTS.values() for k, x in v.items() if getattr(default, k) != x}
    assert branching <= touched
    assert all(SamplingParams(**v) for v in SAMPLER_VARIANTS.values())  # each is a valid request


def test_bucket_lists():
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert piecewise_buckets(100) == [8, 16, 32, 64, 100]
    assert piecewise_buckets(2048)[-3:] == [448, 512, 576]  # the cap (measured: larger steps gain nothing)
    assert piecewise_buckets(2048, cap=1024)[-2:] == [960, 1024]
    assert parse_buckets("64, 128,256", "--x") == [64, 128, 256]
    for bad in ("", "64,32", "0,8", "a"):
        with pytest.raises(ValueError, match="--x"):
            parse_buckets(bad, "--x")
    assert EngineArgs(disable_piecewise_cuda_graph=True).piecewise_tokens == []
    assert EngineArgs(disable_cuda_graph=True).piecewise_tokens == []
    assert EngineArgs(piecewise_cuda_graph_tokens="8,64").piecewise_tokens == [8, 64]
    with pytest.raises(ValueError, match="--piecewise-cuda-graph-tokens"):
        EngineArgs(piecewise_cuda_graph_tokens="64,8")


@pytest.mark.parametrize("cores_only", ["0", "1"])
def test_warmup_runs_the_plans_core_shapes_and_sampler_variants_on_the_sink_page_only(cores_only):
    """Either warmup mode (DSASERVE_WARMUP_CORES_ONLY; on the CPU, with no graphs, the cores-only path takes
    the plain forward) runs every core shape, writing only the sink page."""
    from dsaserve.common import envs
    from dsaserve.engine.kv_pool import KVPool
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.engine.piecewise_runner import PiecewiseRunner
    from dsaserve.engine.warmup import core_batch, warm_core_shapes, warm_sampler

    r = ModelRunner.from_kwargs("glm-5.3-tiny", kv_layout="fp32", num_pages=8)
    pool = KVPool(r.cfg, 8, r.kv_pool.layout, r.model.kv_layer_ids, 64, r.dtype, r.device, sink_pages=1)
    pw = PiecewiseRunner(r.model, pool, [8, 16], 4, 64)
    plan = WarmupPlan.build(4, pw.buckets, 64, 64, r.cfg.index_topk)
    assert {rows for rows, _ in plan.core_shapes} == set(range(1, 17))
    seen = []
    forward = pw.forward
    pw.forward = lambda b: seen.append((b.num_tokens, b.page_table.shape[1])) or forward(b)
    with envs.override(DSASERVE_WARMUP_CORES_ONLY=cores_only):
        assert warm_core_shapes(pw, plan, r.max_model_len) == len(plan.core_shapes)
    assert seen == list(plan.core_shapes)
    assert not pool.kv_buffer[:, : pool.num_pages * 64].any()  # nobody's page was written
    seen.clear()  # every kernel preloaded (engine/warm_start.py): one shape per class, not the row sweep
    assert warm_core_shapes(pw, plan, r.max_model_len, preloaded=True) == len(plan.class_shapes) > 0
    assert seen == list(plan.class_shapes) and len(seen) < len(plan.core_shapes)
    assert warm_sampler(torch.device("cpu"), r.cfg.vocab_size, (1,)) == list(SAMPLER_VARIANTS)
    # a bf16 lm_head's logits (the GPU's): the greedy argmax on them as they are, every variant through float32
    assert warm_sampler(torch.device("cpu"), r.cfg.vocab_size, (1,), torch.bfloat16) == list(SAMPLER_VARIANTS)
    b = core_batch(3, 16, 64, 100, 9)
    assert b.positions.tolist() == [97, 98, 99] and b.page_table.shape == (1, 16)
    assert b.out_cache_loc.tolist() == [9 * 64 + 33, 9 * 64 + 34, 9 * 64 + 35]
    assert dataclasses.replace(b).host_lens() == ([100], [3])
