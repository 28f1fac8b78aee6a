"""Overlap scheduling on CUDA (engine/overlap.py): skipped without a GPU.

Checked here what the CPU tests (test_overlap.py) cannot see: the placeholder ids resolved inside the
captured decode graphs and in eager mixed / prefill steps, the samples' host copy through pinned memory
behind an event, and a sampler that queues its work without waiting for the forward in flight.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsaserve import Engine, SamplingParams
from dsaserve.model.sampler import Sampler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MODEL = "glm-5.3-mini"  # trained: greedy margins are wide, so a near-tie does not decide a comparison


def _prompts(n: int = 12) -> list[list[int]]:
    r = random.Random(0)
    return [[r.randrange(3, 500) for _ in range(r.randrange(1, 200))] for _ in range(n)]


def _engine(overlap: bool) -> Engine:
    eng = Engine(MODEL, device="cuda", num_pages=128, max_num_batched_tokens=4096, max_running_requests=16,
                 disable_overlap_schedule=not overlap)
    assert eng.core.overlap is overlap and (eng.core.runner.graphs is not None)
    return eng


def test_overlapped_steps_on_cuda_give_the_synchronous_tokens():
    """Every request is admitted in the first step and ends by max_tokens, so both engines run the same
    batches (decode steps replay graphs) and must agree to the bit; overlapped, every decode input id was
    a placeholder resolved inside the graph."""
    ps = _prompts()
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=8 + i, ignore_eos=True, logprobs=2)
              for i in range(len(ps))]
    outs = []
    for overlap in (False, True):
        eng = _engine(overlap)
        outs.append([(o.token_ids, o.logprobs) for o in eng.generate(ps, params)])
        s = eng.core.stats()
        assert s["overlap_steps"] > 0 if overlap else s["overlap_steps"] == 0
        eng.core.check_no_leak()
    assert outs[0] == outs[1]


def _after_the_stops(eng: Engine, ps: list[list[int]], stops: list[SamplingParams]) -> list:
    """The stop-token batch, then ps[0] again (its first page now a prefix-cache hit); its outputs."""
    outs = eng.generate(ps, stops)
    return outs + eng.generate([ps[0]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))


def test_stop_tokens_and_aborts_on_cuda_end_where_the_synchronous_engine_ends():
    """The reference is a synchronous engine through the same requests, so both prefill ps[0] a second time over
    the same cached first page (a prefill over a prefix hit runs other kernels at other sizes than the first one:
    compared with a first prefill, the H200 gave [23, 76, ...] against [28, 76, ...] here, the previous stop's
    code too); the overlapped engine must then match it token for token."""
    ps = _prompts()
    first = _engine(False).generate(ps, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    stops = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[o.token_ids[5]]) for o in first]
    ref = _after_the_stops(_engine(False), ps, stops)
    eng = _engine(True)
    for o, r in zip(eng.generate(ps, stops), ref[:-1], strict=True):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason == "stop"
    assert eng.core.stats()["overlap_discarded_tokens"] > 0
    rid = eng.add_request(ps[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    out = None
    while out is None or len(out.token_ids) < 4:  # the owner aborts once it has seen 4 tokens (a stop string)
        out = next((o for o in eng.step() if o.request_id == rid), out)
    seen = len(out.token_ids)
    eng.abort(rid)
    while eng.core.has_unfinished():
        eng.step()
    assert out.finish_reason == "abort" and out.token_ids == ref[-1].token_ids[:seen]  # nothing after the abort
    eng.core.check_no_leak()


def test_sampling_is_queued_without_waiting_for_the_device():
    """torch's sync debug mode raises on any host<->device synchronisation (a `torch.tensor(list,
    device="cuda")`, an index by a host list, `.item()`...) while the sampler queues every kind of row."""

    class Row:
        def __init__(self, sp: SamplingParams, suppressed: tuple[int, ...] = ()):
            self.sampling, self.generator, self.suppressed_token_ids = sp, None, suppressed
            self.prompt_token_ids, self.output_token_ids = [1, 2, 3], [4, 5, 4]

    rows = [Row(SamplingParams(temperature=0)), Row(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1)),
            Row(SamplingParams(temperature=1.0, min_p=0.05, logprobs=3)),
            Row(SamplingParams(temperature=0.5, repetition_penalty=1.2, frequency_penalty=0.3), suppressed=(1, 7)),
            Row(SamplingParams(temperature=1.0))]
    logits = torch.randn(len(rows), 1024, device="cuda")
    sampler = Sampler(seed=0)
    sampler.sample(logits, rows)  # first use: generators and cached tensors are made
    torch.cuda.set_sync_debug_mode("error")
    try:
        future = sampler.sample_async(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = future.result()
    assert len(out.token_ids) == len(rows) and out.logprobs[2] is not None and out.token_ids[3] not in (1, 7)
