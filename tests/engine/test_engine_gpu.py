"""The engine on CUDA (the runner's GPU kernels and CUDA graphs): skipped without a GPU.

Greedy equality with the CPU path is not asserted: the random tiny checkpoint amplifies rounding
differences into different argmaxes (see test_engine_real_model.py). Checked here is the engine itself:
everything finishes with the right lengths, the same batch with the same seeds reproduces, the prefix
cache is reused, no page leaks.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsaserve import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _work() -> tuple[list[list[int]], list[SamplingParams]]:
    r = random.Random(0)
    ps = [[r.randrange(2, 512) for _ in range(r.randrange(1, 300))] for _ in range(24)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(len(ps))]
    return ps, params


def test_a_batch_on_cuda_finishes_and_reproduces_with_the_same_seeds():
    ps, params = _work()
    eng = Engine("glm-5.3-tiny", device="cuda", num_pages=64, max_num_batched_tokens=512, chunked_prefill_size=128,
                 enable_prefix_caching=False)
    first = eng.generate(ps, params)
    again = eng.generate(ps, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in again]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in first)
    eng.core.check_no_leak()


def test_prefix_cache_and_decode_graphs_are_used_on_cuda():
    ps, params = _work()
    eng = Engine("glm-5.3-tiny", device="cuda", num_pages=64, max_num_batched_tokens=512, chunked_prefill_size=128)
    eng.generate(ps, params)
    outs = eng.generate(ps, params)
    assert all(len(o.token_ids) == 12 for o in outs)
    assert eng.core.stats()["prefix_cache_hit_tokens"] > 0
    eng.core.check_no_leak()


def test_graph_replay_of_a_host_batch_equals_the_eager_step_without_pdl(set_switch):
    """A host batch reaches the graph's static inputs through the pinned staging copy (bucket 4 for 3 rows:
    one padding row), and the replayed kernels (launched with PDL on Hopper) give the eager step's logits,
    launched without PDL: a kernel reading its producer's output before it is complete would differ."""
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.model.forward_batch import contiguous_batch

    runner = ModelRunner.from_kwargs("glm-5.3-tiny", dtype="bfloat16", device="cuda", num_pages=32, cuda_graph_max_bs=4)
    prompts = [[5, 6, 7, 8, 9] * 20, [11, 12, 13] * 7, [3] * 150]
    bases = [0, 4 * 64, 8 * 64]
    runner.forward(contiguous_batch(prompts, [0] * 3, bases, runner.page_size))  # prefill, eager
    step = contiguous_batch([[21], [22], [23]], [len(p) for p in prompts], bases, runner.page_size)
    replayed = runner.forward(step).clone()
    assert runner.graphs is not None and step.input_ids.device.type == "cpu"
    set_switch("DSASERVE_PDL", "0")
    eager, _ = runner.model(step.to("cuda"), runner.kv_pool)
    eager = eager.float()
    assert not replayed.isnan().any()
    assert (replayed - eager).norm() / eager.norm() < 1e-2  # same kernels; a race would be far off


def test_short_and_long_decode_batches_replay_their_width_class_and_give_the_eager_logits():
    """Decode graphs in two page-table width classes (engine/decode_graphs.py): glm-5.3-mini's top-64 is one page,
    so a step whose requests hold at most 64 keys replays the narrow class (the indexer takes every key, no long-row
    selection), a longer one the class captured at max_model_len; each gives the eager step's logits."""
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.model.forward_batch import contiguous_batch

    runner = ModelRunner.from_kwargs("glm-5.3-mini", dtype="bfloat16", device="cuda", num_pages=40,
                                     cuda_graph_max_bs=4, max_model_len=1024)
    assert runner.graphs.widths == [1, 16]
    assert runner.manifest()["cuda_graph"]["page_table_widths"] == [1, 16]
    for prompts, width in (([[5, 6, 7] * 15, [11] * 20, [3] * 62], 1), ([[5, 6, 7] * 15, [11] * 300, [3] * 62], 16)):
        bases = [0, 8 * 64, 16 * 64]
        runner.forward(contiguous_batch(prompts, [0] * 3, bases, runner.page_size))  # prefill, eager
        step = contiguous_batch([[21], [22], [23]], [len(p) for p in prompts], bases, runner.page_size)
        assert runner.graphs.runner_for(step) is runner.graphs.runners[width]
        replayed = runner.forward(step).float().clone()
        eager, _ = runner.model(step.to("cuda"), runner.kv_pool)
        assert not replayed.isnan().any()
        assert (replayed - eager.float()).norm() / eager.float().norm() < 1e-2, f"width {width}"


def test_a_one_row_decode_step_replays_its_few_row_class_and_gives_the_eager_logits(monkeypatch):
    """Few-row classes (engine/decode_graphs.py), at glm-5.3-mini's scale: its 2048 positions hold no 32K / 64K-key
    class, so the bounds are 512 / 1024 keys here (8 and 16 pages). A 1- or 2-row step past the top-k replays the
    8-page class, a 3-row one the widest (32 pages); each gives the eager step's logits."""
    from dsaserve.engine import decode_graphs
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.model.forward_batch import contiguous_batch

    monkeypatch.setattr(decode_graphs, "fused_select_widths", lambda: [512, 1024])
    runner = ModelRunner.from_kwargs("glm-5.3-mini", dtype="bfloat16", device="cuda", num_pages=40,
                                     cuda_graph_max_bs=4, max_model_len=2048)
    assert runner.graphs.widths == [1, 32] and runner.graphs.few_row_widths == [8, 16]
    cuda_graph = runner.manifest()["cuda_graph"]
    assert cuda_graph["few_row_page_table_widths"] == [8, 16] and cuda_graph["few_row_max_bs"] == 2
    prompts = [[5, 6, 7] * 40, [11] * 300, [3] * 200]
    bases = [0, 8 * 64, 16 * 64]
    runner.forward(contiguous_batch(prompts, [0] * 3, bases, runner.page_size))  # prefill, eager
    for n, width in ((1, 8), (2, 8), (3, 32)):
        step = contiguous_batch([[21], [22], [23]][:n], [len(p) for p in prompts][:n], bases[:n], runner.page_size)
        assert runner.graphs.runner_for(step) is {**runner.graphs.runners, **runner.graphs.few}[width]
        replayed = runner.forward(step).float().clone()
        eager, _ = runner.model(step.to("cuda"), runner.kv_pool)
        assert not replayed.isnan().any()
        assert (replayed - eager.float()).norm() / eager.float().norm() < 1e-2, f"{n} rows, width {width}"


@pytest.mark.parametrize("h2d_in_graph", ["1", "0"])
def test_steps_staged_while_the_step_before_waits_give_the_one_at_a_time_logits(set_switch, h2d_in_graph):
    """Back-to-back replays (overlap scheduling's order): a step's host batch is staged once the step before has
    copied its own (the `staged` event beside each graph's copy, or after the copy call outside the graphs with
    DSASERVE_GRAPH_H2D=0), not once it has finished. With the device held busy the steps queue up behind each
    other's copies: staging before the copy before it would overwrite the pinned inputs it still has to read,
    and the steps would read each other's tokens."""
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.model.forward_batch import contiguous_batch

    set_switch("DSASERVE_GRAPH_H2D", h2d_in_graph)
    runner = ModelRunner.from_kwargs("glm-5.3-tiny", dtype="bfloat16", device="cuda", num_pages=32, cuda_graph_max_bs=4)
    assert h2d_in_graph == "1" or not runner.graphs.copy_in_graph
    prompts, bases = [[5, 6, 7] * 30, [11, 12] * 40, [3] * 150], [0, 4 * 64, 8 * 64]
    runner.forward(contiguous_batch(prompts, [0] * 3, bases, runner.page_size))
    lens = [len(p) for p in prompts]
    steps = [contiguous_batch([[21 + i], [40 + 3 * i], [90 - i]], lens, bases, runner.page_size) for i in range(4)]
    one_at_a_time = []
    for step in steps:
        one_at_a_time.append(runner.forward(step).clone())
        torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # ~50 ms of device time queued before the first step
    queued = [runner.forward(step).clone() for step in steps]  # each clone is queued behind its replay
    torch.cuda.synchronize()
    for i, (want, got) in enumerate(zip(one_at_a_time, queued, strict=True)):
        assert (got - want).norm() / want.norm() < 1e-3, f"step {i}"
    assert (one_at_a_time[0] - one_at_a_time[1]).norm() / one_at_a_time[0].norm() > 1e-2  # the steps differ


# max_deltas 2: most steps copy the whole mirror; mixed: the 1-2-row buckets copy their table whole, 4 rows do not
@pytest.mark.parametrize("max_deltas,keyed,mixed", [(None, True, False), (None, False, False), (2, True, False),
                                                    (None, True, True)])
def test_a_device_resident_page_table_changed_in_place_gives_the_eager_logits_one_by_one_and_queued(
        monkeypatch, max_deltas, keyed, mixed):
    """Every class keeps the requests' pages on the device and stages only their changes (engine/
    page_table_mirror.py), keyed by the builder's rows and generations or (keyed False) by the batch's rows, compared
    whole: steps whose rows swap requests, shrink into a smaller bucket (padding rows) and grow again replay the eager
    logits, one at a time and queued back to back (a step staged over the one before it would read the wrong pages).
    Mixed: the buckets that copy their table whole leave the mirror behind, and the next mirrored step catches up."""
    import numpy as np

    from dsaserve.engine import cuda_graph_runner
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.model.forward_batch import contiguous_batch

    monkeypatch.setattr(cuda_graph_runner, "TABLE_MIRROR_MIN_BYTES", 0)
    if max_deltas is not None:
        monkeypatch.setattr(cuda_graph_runner.CudaGraphRunner, "_max_deltas", lambda self, dev: max_deltas)
    if mixed:
        monkeypatch.setattr(cuda_graph_runner.CudaGraphRunner, "_mirrors", lambda self, bucket: bucket > 2)
    runner = ModelRunner.from_kwargs("glm-5.3-tiny", dtype="bfloat16", device="cuda", num_pages=32, cuda_graph_max_bs=4)
    assert runner.graphs.copy_in_graph and all(r.mirror is not None for r in runner.graphs._all())
    assert runner.graphs.widest.mirrored == ({4} if mixed else {1, 2, 4})
    assert runner.manifest()["cuda_graph"]["page_table_on_device_widths"] == sorted({*runner.graphs.widths,
                                                                                     *runner.graphs.few_row_widths})
    prompts = [[5, 6, 7] * 30, [11, 12] * 40, [3] * 150, [9, 8] * 70]
    bases = [0, 4 * 64, 8 * 64, 12 * 64]
    runner.forward(contiguous_batch(prompts, [0] * 4, bases, runner.page_size))
    lens = [len(p) for p in prompts]
    orders = [[0, 1, 2], [1, 0, 2], [2, 1], [0, 1, 2, 3], [3, 0], [3, 2, 1, 0]]
    steps = [contiguous_batch([[21 + i + k] for k in o], [lens[k] for k in o], [bases[k] for k in o], runner.page_size)
             for i, o in enumerate(orders)]
    for step, order in zip(steps, orders, strict=True):  # request k holds builder row k, its first generation
        step.table_rows, step.table_gens = (np.array(order), np.ones(len(order), dtype=np.int64)) if keyed else (None,
                                                                                                                 None)
    one_at_a_time = []
    for step in steps:
        one_at_a_time.append(runner.forward(step).float().clone())
        eager, _ = runner.model(step.to("cuda"), runner.kv_pool)
        assert (one_at_a_time[-1] - eager.float()).norm() / eager.float().norm() < 1e-2, f"{step.seq_lens_cpu}"
    torch.cuda._sleep(100_000_000)  # ~50 ms of device time queued before the first step
    queued = [runner.forward(step).float().clone() for step in steps]
    torch.cuda.synchronize()
    for i, (want, got) in enumerate(zip(one_at_a_time, queued, strict=True)):
        assert (got - want).norm() / want.norm() < 1e-3, f"step {i}"


def test_indexer_selection_on_the_side_stream_gives_the_one_stream_logits(set_switch):
    """Full layers run the indexer's selection on a side stream beside the q path; with every kernel on one
    stream (DSASERVE_OVERLAP_INDEXER=0) the step's logits are the same, eager and replayed. Contexts of 150
    and 400 tokens make the tiny config (index_topk 8) select, so a read of the slots before the selection
    finished, or of an input the main stream already reused, would change the logits."""
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.model.forward_batch import contiguous_batch

    runner = ModelRunner.from_kwargs("glm-5.3-tiny", dtype="bfloat16", device="cuda", num_pages=32, cuda_graph_max_bs=2)
    prompts, bases = [[3, 4] * 75, [9] * 400], [0, 8 * 64]
    runner.forward(contiguous_batch(prompts, [0, 0], bases, runner.page_size))
    step = contiguous_batch([[21], [22]], [len(p) for p in prompts], bases, runner.page_size)
    overlapped = runner.model(step.to("cuda"), runner.kv_pool)[0].float()
    replayed = runner.forward(step).float()
    set_switch("DSASERVE_OVERLAP_INDEXER", "0")
    one_stream = runner.model(step.to("cuda"), runner.kv_pool)[0].float()
    for got in (overlapped, replayed):
        assert (got - one_stream).norm() / one_stream.norm() < 1e-2


def test_experts_touched_counted_on_the_side_stream_equal_the_one_stream_count(set_switch):
    """Decode-size steps count the distinct experts they route to on the indexer's side stream (off the chain of
    kernels the step waits for), eagerly and inside the replayed graph; with every kernel on one stream the
    count is the same. Four rows of different tokens route to more experts than one row does."""
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.model.forward_batch import contiguous_batch
    from dsaserve.model.layers.moe import fold_device_expert_counts

    runner = ModelRunner.from_kwargs("glm-5.3-tiny", dtype="bfloat16", device="cuda", num_pages=32, cuda_graph_max_bs=4)
    prompts, bases = [[3, 4] * 40, [9] * 100, [7, 8, 9] * 30, [5] * 70], [0, 4 * 64, 8 * 64, 12 * 64]
    runner.forward(contiguous_batch(prompts, [0] * 4, bases, runner.page_size))
    step = contiguous_batch([[21], [22], [300], [401]], [len(p) for p in prompts], bases, runner.page_size)

    def touched(run) -> float:
        fold_device_expert_counts(reset=True)
        run()
        torch.cuda.synchronize()
        return fold_device_expert_counts(reset=True)["moe_experts_touched"]

    side = touched(lambda: runner.model(step.to("cuda"), runner.kv_pool))
    replayed = touched(lambda: runner.forward(step))
    set_switch("DSASERVE_OVERLAP_INDEXER", "0")
    one_stream = touched(lambda: runner.model(step.to("cuda"), runner.kv_pool))
    single = touched(lambda: runner.model(contiguous_batch([[21]], [len(prompts[0])], bases[:1], runner.page_size)
                                          .to("cuda"), runner.kv_pool))
    assert side == replayed == one_stream > single > 0


def test_unfused_shared_expert_on_the_side_stream_gives_the_one_stream_logits(set_switch, monkeypatch):
    """Decode batches past the unsorted MoE kernel's sizes (here 160 rows of top-2: 320 pairs) run the shared
    expert apart, on the side stream beside the routed experts, joined before their combine; with every kernel
    on one stream the step's logits are the same (the same kernels: bit for bit)."""
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.kernels import triton_moe
    from dsaserve.model.forward_batch import contiguous_batch

    sides = []
    beside = triton_moe._shared_beside
    monkeypatch.setattr(triton_moe, "_shared_beside", lambda sh, x, side: sides.append(side) or beside(sh, x, side))
    rows = 160
    runner = ModelRunner.from_kwargs("glm-5.3-tiny", dtype="bfloat16", device="cuda", num_pages=200,
                                     cuda_graph_max_bs=1)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(20)] for i in range(rows)]
    bases = [i * runner.page_size for i in range(rows)]
    runner.forward(contiguous_batch(prompts, [0] * rows, bases, runner.page_size))
    step = contiguous_batch([[i + 21] for i in range(rows)], [len(p) for p in prompts], bases, runner.page_size)
    sides.clear()
    got = runner.model(step.to("cuda"), runner.kv_pool)[0].float()
    assert sides and all(s is not None for s in sides), "the shared expert did not go to the side stream"
    set_switch("DSASERVE_OVERLAP_INDEXER", "0")
    one_stream = runner.model(step.to("cuda"), runner.kv_pool)[0].float()
    assert torch.isfinite(got).all() and torch.equal(got, one_stream)
