"""Piecewise CUDA graphs and warmup coverage on CUDA (skipped without a GPU): a mixed prefill + decode step
replays the piecewise graphs and gives the logits of its eager segments and of the plain forward; after
startup a workload of mixed prompt lengths, concurrencies and sampling parameters compiles no Triton kernel
(issue 16: `kernel_compiles_after_up` and the JIT's own count stay 0) and runs no step eagerly."""

from __future__ import annotations

import random

import pytest
import torch

from dsaserve.common.counters import COUNTERS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_a_mixed_step_replays_the_piecewise_graphs_with_the_eager_logits():
    """2 decode rows at contexts 150 / 400 (the tiny config's top-k of 8 really selects) + a 30-token prompt:
    32 tokens, bucket 32. A segment overwriting what a core still reads (a wrong weak reference) or a core
    reading stale inputs would be far off."""
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.model.forward_batch import contiguous_batch

    runner = ModelRunner.from_kwargs("glm-5.3-tiny", dtype="bfloat16", device="cuda", num_pages=64,
                                     max_num_batched_tokens=512, max_running_requests=8)
    pw = runner.piecewise
    assert pw is not None and 32 in pw.graphs, runner.manifest()["piecewise_cuda_graph"]
    prompts, bases = [[3, 4] * 75, [9] * 400, list(range(5, 35))], [0, 8 * 64, 16 * 64]
    for p, base in zip(prompts[:2], bases, strict=False):
        runner.forward(contiguous_batch([p], [0], [base], runner.page_size))
    mixed = contiguous_batch([[21], [22], prompts[2]], [150, 400, 0], bases, runner.page_size)
    before = COUNTERS.snapshot()
    replayed = runner.forward(mixed).float().clone()
    diff = COUNTERS.diff(COUNTERS.snapshot(), before)
    assert diff.get("piecewise_replays") == 1 and not any(k.startswith("eager_fallbacks") for k in diff)
    graphs = pw.graphs.pop(32)
    try:
        eager_segments = pw.forward(mixed).float()
    finally:
        pw.graphs[32] = graphs
    plain = runner.model(mixed.to("cuda"), runner.kv_pool)[0].float()
    assert not replayed.isnan().any()
    assert _rel(replayed, eager_segments) < 1e-3  # the same kernels at the same shapes
    assert _rel(replayed, plain) < 2e-2  # GEMMs of 32 rows against 32 real rows: other tiles, same math
    assert torch.equal(replayed.argmax(-1), eager_segments.argmax(-1))


def _workload(seed: int, n: int, vocab: int):
    from dsaserve import SamplingParams

    r = random.Random(seed)
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=1), dict(temperature=0.7, top_k=20),
             dict(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3), dict(temperature=0.0, logprobs=3),
             dict(temperature=1.0, min_p=0.1, min_tokens=4)]
    prompts = [[r.randrange(2, vocab) for _ in range(r.choice([1, 7, 60, 200, 700, 1500, 2500]))] for _ in range(n)]
    params = [SamplingParams(max_tokens=r.randrange(2, 24), ignore_eos=True, **r.choice(kinds)) for _ in range(n)]
    return prompts, params


@pytest.mark.parametrize("cores_only", ["0", "1"])
def test_no_kernel_compiles_after_up_under_mixed_lengths_and_concurrency(tmp_path, monkeypatch, cores_only):
    """Prompts of 1..2500 tokens (page tables 1..40 pages wide), chunked at 128 tokens beside running
    decodes, 1 to 24 requests at once, every sampling kind: every step replays a decode graph or the
    piecewise graphs, and nothing compiles after Up — neither a new cache file nor a JIT miss. Both warmup
    modes: full steps, and the attention cores alone (DSASERVE_WARMUP_CORES_ONLY=1)."""
    from dsaserve import Engine
    from dsaserve.common import envs

    with envs.override(DSASERVE_WARMUP_CORES_ONLY=cores_only):
        eng = Engine("glm-5.3-tiny", device="cuda", num_pages=1024, max_num_batched_tokens=256,
                     chunked_prefill_size=128, max_running_requests=24)
    runner = eng.core.runner
    assert runner.piecewise is not None and runner.graphs is not None
    assert runner.warmed["core_shapes"] > 0 and runner.warmed["sampler_variants"]
    before = COUNTERS.snapshot()
    for seed, n in ((0, 1), (1, 4), (2, 24), (3, 9)):
        outs = eng.generate(*_workload(seed, n, runner.cfg.vocab_size))
        assert all(o.finish_reason == "length" for o in outs)
    diff = COUNTERS.diff(COUNTERS.snapshot(), before)
    eager = {k: v for k, v in diff.items() if k.startswith("eager_fallbacks.")}
    assert eager == {}, eager
    assert diff.get("piecewise_replays", 0) > 0 and diff.get("graph_replays", 0) > 0
    assert runner.compile_cache.compiles_after_up()["kernel_compiles_after_up"] == 0
    if runner.kernel_loads.installed:  # Triton >= 3.4: the JIT's own count, whatever the disk cache held
        assert runner.kernel_loads.read()["kernel_loads_after_up"] == 0
    eng.core.check_no_leak()


def test_graphs_captured_without_their_own_eager_run_replay_the_eager_logits():
    """capture(warm_each=False), a warm start's: only the largest bucket runs eagerly before its capture. A smaller
    bucket's piecewise graphs (32 of 64) and decode graph (4 of 8) must still give the eager logits, and the
    piecewise buffers a core warmup reads must be finite (replayed once after the capture)."""
    from dsaserve.engine.cuda_graph_runner import CudaGraphRunner
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.engine.piecewise_runner import PiecewiseRunner
    from dsaserve.model.forward_batch import contiguous_batch

    runner = ModelRunner.from_kwargs("glm-5.3-tiny", dtype="bfloat16", device="cuda", num_pages=64,
                                     max_num_batched_tokens=512, max_running_requests=8, cuda_graph_max_bs=8)
    pool, bases = runner.kv_pool, [0, 8 * 64, 16 * 64]
    for p, base in zip([[3, 4] * 75, [9] * 400], bases, strict=False):
        runner.forward(contiguous_batch([p], [0], [base], runner.page_size))
    pw = PiecewiseRunner(runner.model, pool, [32, 64], 8, 16)
    pw.capture(warm_each=False)
    assert pw.capture_retries == 0 and sorted(pw.graphs) == [32, 64]
    assert all(torch.isfinite(s.carry.attn.q_abs).all() for s in pw.graphs[32] if s.carry.attn is not None)
    mixed = contiguous_batch([[21], [22], list(range(5, 35))], [150, 400, 0], bases, runner.page_size)
    replayed = pw.forward(mixed).float()
    graphs = pw.graphs.pop(32)
    eager = pw.forward(mixed).float()
    pw.graphs[32] = graphs
    assert _rel(replayed, eager) < 1e-3 and torch.equal(replayed.argmax(-1), eager.argmax(-1))

    dec = CudaGraphRunner(runner.model, pool, 8, 16, pool.sink_page)
    dec.capture(warm_each=False)
    assert dec.capture_retries == 0 and sorted(dec.graphs) == [1, 2, 4, 8]
    step = contiguous_batch([[31], [32], [33]], [151, 401, 30], bases, runner.page_size)
    graph_logits = dec.replay(step).float().clone()
    plain = runner.model(step.to("cuda"), pool)[0].float()
    assert _rel(graph_logits, plain) < 2e-2 and torch.equal(graph_logits.argmax(-1), plain.argmax(-1))
