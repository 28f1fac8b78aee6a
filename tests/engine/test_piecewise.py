"""Piecewise CUDA graphs on the CPU (engine/piecewise_runner.py): nothing is captured off CUDA, so the same
segments run eagerly with each layer's attention core between them. Pinned here: segmented == plain forward
bit for bit (fp32) on a mixed prefill + decode workload, padding rows change no real row or page, the
staging lands where the segments and the core read, and ModelRunner routes by reason. (Capture and replay:
tests/engine/test_piecewise_gpu.py.)"""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.counters import COUNTERS
from dsaserve.engine.kv_pool import KVPool
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.engine.piecewise_runner import PiecewiseRunner, weak_ref
from dsaserve.kernels.variants import CORE_WIDTH_ALIGN
from dsaserve.model.forward_batch import ForwardBatch, contiguous_batch

PAGES = 48
BASES = [0, 10 * 64, 20 * 64, 30 * 64]


@pytest.fixture(scope="module", params=["glm-5.3-tiny", "glm-5.3-mini"])
def runner(request) -> ModelRunner:
    return ModelRunner.from_kwargs(request.param, kv_layout="fp32", num_pages=PAGES)


def _pool(r: ModelRunner) -> KVPool:
    return KVPool(r.cfg, PAGES, r.kv_pool.layout, r.model.kv_layer_ids, 64, r.dtype, r.device, sink_pages=1)


def _workload(cfg) -> list[ForwardBatch]:
    """Chunked prefills with the others decoding (mixed steps), contexts past index_topk (the indexer
    really selects) and over several pages."""
    g = torch.Generator().manual_seed(3)
    n = [4 * cfg.index_topk + 37, 150, 9, 301]
    toks = [torch.randint(2, cfg.vocab_size, (k,), generator=g).tolist() for k in n]
    first = contiguous_batch([toks[0], toks[1][:100], toks[2]], [0, 0, 0], BASES[:3])
    first.logits_indices = torch.arange(first.num_tokens)  # every position: each row's logits checked
    mixed = contiguous_batch([[5], toks[1][100:], [7], toks[3][:200]], [n[0], 100, n[2], 0], BASES)
    tail = contiguous_batch([[8], [9], [10], toks[3][200:]], [n[0] + 1, n[1], n[2] + 1, 200], BASES)
    decode = contiguous_batch([[11], [12], [13], [14]], [n[0] + 2, n[1] + 1, n[2] + 2, n[3]], BASES)
    return [first, mixed, tail, decode]


def _run(fwd, batches: list[ForwardBatch]) -> list[torch.Tensor]:
    return [fwd(b) for b in batches]


def _real_slots(pool: KVPool) -> slice:
    return slice(0, pool.num_pages * pool.page_size)  # the sink page follows them


def test_segmented_forward_equals_the_plain_forward_bit_for_bit(runner):
    """Buckets equal to each step's token count (no padding): the same ops in the same order, so the same
    bits: logits of every step and every byte of the KV pool and indexer cache."""
    batches = _workload(runner.cfg)
    plain_pool, seg_pool = _pool(runner), _pool(runner)
    plain = _run(lambda b: runner.model(b, plain_pool)[0], batches)
    pw = PiecewiseRunner(runner.model, seg_pool, sorted({b.num_tokens for b in batches}), 8, PAGES)
    assert pw.capture() == pw.buckets and not pw.graphs  # off CUDA: warmed, nothing captured
    seg = _run(pw.forward, batches)
    for a, b in zip(plain, seg, strict=True):
        assert torch.equal(a, b)
    real = _real_slots(seg_pool)  # the sink page took the capture's warm run
    assert torch.equal(plain_pool.kv_buffer[:, real], seg_pool.kv_buffer[:, real])
    assert torch.equal(plain_pool.index_buffer[:, real], seg_pool.index_buffer[:, real])


def test_padding_rows_change_no_real_row_and_no_real_page(runner):
    """Buckets above the token counts: padded rows are token 0 at position 0 writing the sink page, with a
    zero attention output. Real rows' logits agree (GEMMs of more rows may round differently) with the
    same argmax, and every real KV slot holds what the plain forward wrote."""
    batches = _workload(runner.cfg)
    plain_pool, seg_pool = _pool(runner), _pool(runner)
    plain = _run(lambda b: runner.model(b, plain_pool)[0], batches)
    pw = PiecewiseRunner(runner.model, seg_pool, [8, 64, 512, 1024], 8, PAGES)
    assert [pw.fallback_reason(b) for b in batches] == [None] * 4
    seg = _run(pw.forward, batches)
    for a, b in zip(plain, seg, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))
    real = _real_slots(seg_pool)
    for buf in ("kv_buffer", "index_buffer"):
        got, want = (getattr(p, buf)[:, real].view(torch.float32) for p in (seg_pool, plain_pool))  # fp32 layout
        assert torch.equal(got.ne(0).any(-1), want.ne(0).any(-1))  # the same slots written, no others
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert seg_pool.kv_buffer[:, seg_pool.sink_page * 64:].any()  # the padding rows wrote there


def test_a_host_batch_is_staged_where_segments_and_core_read_it(runner):
    pw = PiecewiseRunner(runner.model, _pool(runner), [16, 64], 8, PAGES)
    batch = contiguous_batch([[21, 22, 23], [24]], [0, 70], [0, 2 * 64])
    core = pw._stage(batch, 16)
    t, sink = pw.stride, pw.sink_slot
    assert pw.dev[:5].tolist() == [21, 22, 23, 24, 0] and pw.dev[5:16].eq(0).all()
    assert pw.dev[t:t + 4].tolist() == [0, 1, 2, 70] and pw.dev[t + 4:t + 16].eq(0).all()
    assert pw.dev[2 * t:2 * t + 4].tolist() == [0, 1, 2, 2 * 64 + 70] and pw.dev[2 * t + 4:2 * t + 16].eq(sink).all()
    assert core.input_ids.tolist() == [21, 22, 23, 24] and core.positions.tolist() == [0, 1, 2, 70]
    assert core.req_index.tolist() == [0, 0, 0, 1] and core.seq_lens.tolist() == [3, 71]
    assert core.extend_lens.tolist() == [3, 1] and core.logits_indices.tolist() == [2, 3]
    assert core.page_table.shape == (2, CORE_WIDTH_ALIGN)  # width 2 padded: one compiled variant per class
    assert core.page_table[:, :2].tolist() == [[0, 0], [2, 3]] and core.page_table[:, 2:].eq(pw.pool.sink_page).all()
    assert core.host_lens() == ([3, 71], [3, 1])
    for field in (core.positions, core.req_index, core.page_table):  # the core's kernels see aligned pointers
        assert (field.data_ptr() - pw.dev.data_ptr()) % 128 == 0


def test_the_runner_routes_mixed_steps_to_the_piecewise_path_and_counts_eager_reasons(runner):
    """With graph runners present every step takes a graph path or is counted eager by reason."""
    batches = _workload(runner.cfg)
    plain_pool = _pool(runner)
    plain = _run(lambda b: runner.model(b, plain_pool)[0], batches)
    saved = runner.kv_pool
    runner.kv_pool = _pool(runner)
    runner.piecewise = PiecewiseRunner(runner.model, runner.kv_pool, [8, 128], 8, PAGES)
    try:
        before = COUNTERS.snapshot()
        got = _run(runner.forward, batches)
        diff = COUNTERS.diff(COUNTERS.snapshot(), before)
    finally:
        runner.kv_pool, runner.piecewise = saved, None
    eager = {k: v for k, v in diff.items() if k.startswith("eager_fallbacks.")}
    assert [b.num_tokens > 128 for b in batches] == [True, True, False, False]
    assert eager == {"eager_fallbacks.tokens_over_piecewise_max": 2}
    for a, b in zip(plain[:2], got[:2], strict=True):  # those ran the plain forward
        assert torch.equal(a, b)
    for a, b in zip(plain[2:], got[2:], strict=True):
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_fallback_reasons_name_what_is_over_the_capture():
    pool = KVPool(_cfg(), 8, "fp32", None, 64, torch.float32, "cpu", sink_pages=1)
    pw = PiecewiseRunner(model=None, pool=pool, buckets=[16, 32], max_rows=2, max_pages=3)
    assert pw.max_pages == CORE_WIDTH_ALIGN  # the core's widest padded page table
    assert pw.fallback_reason(contiguous_batch([[1] * 33], [0], [0])) == "tokens_over_piecewise_max"
    assert pw.fallback_reason(contiguous_batch([[1], [2], [3]], [0, 0, 0], [0, 64, 128])) == "rows_over_piecewise_max"
    wide = contiguous_batch([[1]], [17 * 64], [0])
    assert pw.fallback_reason(wide) == "context_over_capture"
    assert pw.fallback_reason(contiguous_batch([[1] * 20, [2]], [0, 5], [0, 64])) is None


def test_a_pool_without_a_sink_page_is_refused():
    pool = KVPool(_cfg(), 8, "fp32", None, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="sink page"):
        PiecewiseRunner(model=None, pool=pool, buckets=[16], max_rows=2, max_pages=3)


def test_weak_references_are_only_taken_on_cuda():
    t = torch.ones(3)
    assert weak_ref(t) is t and weak_ref(None) is None


def _cfg():
    from dsaserve.config import load_config

    return load_config("glm-5.3-tiny")
