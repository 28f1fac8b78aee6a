"""Scheduler + batch building + EngineCore, on the fake runner (tests/engine/fake_runner.py), which reads
its KV back through the page table: any paging, sharing or caching bug changes the tokens or raises."""

from __future__ import annotations

import random

import pytest

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.request import EngineRequest
from tests.engine.fake_runner import EOS, FakeRunner, fake_greedy, prompts

GREEDY = dict(temperature=0.0)


def make_core(num_pages: int = 64, **kw) -> EngineCore:
    runner = FakeRunner(num_pages=num_pages, max_position_embeddings=kw.pop("context", 4096))
    return EngineCore(EngineArgs(**kw), runner=runner)


def add(core: EngineCore, rid: str, prompt: list[int], **sp) -> None:
    core.add_request(EngineRequest(rid, prompt, SamplingParams(**{**GREEDY, **sp})))


def run(core: EngineCore, max_steps: int = 10_000, out: dict | None = None) -> dict[tuple[str, int], dict]:
    """Step to the end; per (request, sample): tokens, finish_reason, cached_tokens (added to `out`)."""
    out = {} if out is None else out
    for _ in range(max_steps):
        if not core.has_unfinished():
            return out
        collect(core.step(), out)
    raise AssertionError(f"not finished after {max_steps} steps (deadlock?): {core.stats()}")


def collect(deltas, out) -> None:
    for d in deltas:
        o = out.setdefault((d.request_id, d.index), {"tokens": [], "reason": None})
        o["tokens"] += d.new_token_ids
        o["cached"] = d.cached_tokens
        if d.finished:
            o["reason"], o["stop_reason"] = d.finish_reason, d.stop_reason


def test_forty_requests_arriving_over_time_match_running_alone():
    core = make_core(num_pages=48, max_num_batched_tokens=96, chunked_prefill_size=40, max_running_requests=16)
    ps = prompts(45, 1, 300, seed=1)
    max_toks = [random.Random(i).randrange(1, 40) for i in range(len(ps))]
    out: dict = {}
    for i in range(0, len(ps), 3):  # three arrive per step, while earlier ones prefill and decode
        for j in range(i, min(i + 3, len(ps))):
            add(core, f"r{j}", ps[j], max_tokens=max_toks[j])
        collect(core.step(), out)
    run(core, out=out)
    for j, p in enumerate(ps):
        assert out[(f"r{j}", 0)]["tokens"] == fake_greedy(p, max_toks[j]), j
    mixed = [b for b in core.runner.batches if 1 in b.extend_lens_cpu and max(b.extend_lens_cpu) > 1]
    assert mixed, "no step mixed decode tokens with a prefill chunk"
    core.check_no_leak()


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_prefill_equals_unchunked(chunk):
    ps = prompts(4, 100, 200, seed=2)
    ref = make_core(max_num_batched_tokens=2048)
    small = make_core(max_num_batched_tokens=max(chunk, 8), chunked_prefill_size=chunk)
    for core in (ref, small):
        for i, p in enumerate(ps):
            add(core, f"r{i}", p, max_tokens=12)
    a, b = run(ref), run(small)
    assert a == b
    assert all(max(x.extend_lens_cpu) <= chunk for x in small.runner.batches)
    assert max(max(x.extend_lens_cpu) for x in ref.runner.batches) > 100  # the reference really was unchunked


def test_prefix_cache_hit_gives_the_same_output_and_computes_only_the_suffix():
    shared = prompts(1, 200, 200, seed=3)[0]
    p2 = shared + [65, 66, 67]
    miss = make_core(enable_prefix_caching=False)
    add(miss, "b", p2, max_tokens=10, ignore_eos=True)
    expect = run(miss)[("b", 0)]["tokens"]

    core = make_core()
    add(core, "a", shared, max_tokens=5, ignore_eos=True)
    run(core)
    before = core.stats()["computed_tokens"]
    add(core, "b", p2, max_tokens=10, ignore_eos=True)
    got = run(core)[("b", 0)]
    assert got["tokens"] == expect
    hit = 192  # three full 64-token pages of the shared 200-token prefix
    assert got["cached"] == hit and core.stats()["prefix_cache_hit_tokens"] == hit
    # computed: the uncached prompt suffix, then one token per decode step (the last sample is never fed back)
    assert core.stats()["computed_tokens"] - before == (len(p2) - hit) + (10 - 1)
    core.check_no_leak()


def test_whole_prompt_cached_still_computes_its_last_token():
    p = prompts(1, 128, 128, seed=4)[0]
    core = make_core()
    add(core, "a", p, max_tokens=3, ignore_eos=True)
    first = run(core)[("a", 0)]["tokens"]
    add(core, "b", p, max_tokens=3, ignore_eos=True)
    out = run(core)[("b", 0)]
    assert out["tokens"] == first and out["cached"] == 64  # page 2 holds the last token: recomputed


@pytest.mark.parametrize("caching", [True, False])
def test_pool_far_too_small_finishes_everything_correctly_through_preemption(caching):
    core = make_core(num_pages=6, max_num_batched_tokens=64, chunked_prefill_size=32, max_running_requests=12,
                     enable_prefix_caching=caching)
    ps = prompts(24, 20, 150, seed=5)
    for i, p in enumerate(ps):
        add(core, f"r{i}", p, max_tokens=60, ignore_eos=True)
    out = run(core, max_steps=20_000)
    for i, p in enumerate(ps):
        assert out[(f"r{i}", 0)]["tokens"] == fake_greedy(p, 60, ignore_eos=True), i
    assert core.stats()["preemptions"] > 0
    core.check_no_leak()


def test_abort_mid_prefill_mid_decode_and_while_waiting_frees_every_page():
    core = make_core(num_pages=16, max_num_batched_tokens=32, chunked_prefill_size=16, max_running_requests=2)
    ps = prompts(4, 120, 120, seed=6)
    for i, p in enumerate(ps):
        add(core, f"r{i}", p, max_tokens=50, ignore_eos=True)
    core.step()
    assert core.scheduler.groups["r0"][0].num_computed == 16  # r0 is mid-prefill
    assert core.abort_request("r0")
    assert core.abort_request("r3")  # still waiting (two running at most)
    out: dict = {}
    for _ in range(20):
        collect(core.step(), out)
    r1 = core.scheduler.groups["r1"][0]
    assert r1.num_output > 0  # r1 is decoding
    assert core.abort_request("r1")
    assert not core.abort_request("r1") and not core.abort_request("nope")
    run(core, out=out)
    assert {k: v["reason"] for k, v in out.items()} == {("r0", 0): "abort", ("r1", 0): "abort",
                                                          ("r2", 0): "length", ("r3", 0): "abort"}
    assert out[("r2", 0)]["tokens"] == fake_greedy(ps[2], 50, ignore_eos=True)
    core.check_no_leak()


def test_n_samples_share_the_prompt_pages():
    core = make_core()
    p = prompts(1, 200, 200, seed=7)[0]  # 3 full pages + a partial one
    add(core, "a", p, max_tokens=8, n=4, ignore_eos=True)
    out: dict = {}
    collect(core.step(), out)  # leader prefills, samples for all four, followers fork
    assert core.stats()["num_running"] == 4
    collect(core.step(), out)  # followers compute their partial page
    assert core.stats()["kv_pages_used"] == 3 + 4  # not 4 x 4
    run(core, out=out)
    expect = fake_greedy(p, 8, ignore_eos=True)
    assert [out[("a", i)]["tokens"] for i in range(4)] == [expect] * 4
    core.check_no_leak()


def test_n_samples_with_a_seed_differ_from_each_other_and_repeat_across_runs():
    def sample() -> list[list[int]]:
        core = make_core()
        add(core, "a", prompts(1, 70, 70, seed=8)[0], max_tokens=6, n=3, temperature=1.5, seed=11,
            ignore_eos=True)
        out = run(core)
        return [out[("a", i)]["tokens"] for i in range(3)]

    first = sample()
    assert first == sample()
    assert len({tuple(x) for x in first}) == 3


def test_bad_requests_raise_clear_errors_and_the_engine_keeps_serving():
    core = make_core(num_pages=4, max_running_requests=4)  # 256-token pool
    assert core.scheduler_info["max_req_input_len"] == 255
    good = prompts(1, 30, 30, seed=9)[0]
    add(core, "ok", good, max_tokens=5, ignore_eos=True)
    cases = [
        ("long", [40] * 256, {}, "prompt_token_ids: .*256 tokens.*max_req_input_len = 255"),
        ("ctx", [40] * 250, {"max_tokens": 10}, "max_tokens: .*exceeds the context limit of 256"),
        ("empty", [], {}, "prompt_token_ids: the prompt is empty"),
        ("vocab", [40, 128], {}, "prompt_token_ids: token id 128"),
        ("n", [40], {"n": 5}, "n: 5 samples exceed --max-running-requests of 4"),
        ("ok", [40], {}, "request_id: 'ok' is already in flight"),
    ]
    for rid, p, sp, msg in cases:
        with pytest.raises(ValueError, match=msg):
            add(core, rid, p, **sp)
    with pytest.raises(ValueError, match="^temperature"):
        add(core, "t", [40], temperature=-1)
    out = run(core)
    assert out == {("ok", 0): {"tokens": fake_greedy(good, 5, ignore_eos=True), "reason": "length",
                               "cached": 0, "stop_reason": None}}
    core.check_no_leak()


def test_max_req_input_len_is_the_smaller_of_pool_and_context():
    assert make_core(num_pages=4).scheduler_info["max_req_input_len"] == 255
    assert make_core(num_pages=64, context=100).scheduler_info["max_req_input_len"] == 99
    assert make_core(num_pages=64, max_model_len=300).scheduler_info["max_req_input_len"] == 299


def test_finish_reasons_eos_stop_token_min_tokens_ignore_eos_and_length():
    p = next(q for q in prompts(200, 5, 40, seed=10) if EOS in fake_greedy(q, 30)[3:])
    natural = fake_greedy(p, 30)
    k = natural.index(EOS)
    core = make_core()
    add(core, "eos", p, max_tokens=30)
    add(core, "ign", p, max_tokens=k + 3, ignore_eos=True)
    add(core, "stop_id", p, max_tokens=30, stop_token_ids=[natural[1]])
    add(core, "len", p, max_tokens=2)
    add(core, "min", p, max_tokens=k + 3, min_tokens=k + 2)
    out = run(core)
    assert out[("eos", 0)]["tokens"] == natural and out[("eos", 0)]["reason"] == "stop"
    assert out[("eos", 0)]["stop_reason"] is None
    assert out[("ign", 0)]["tokens"][k] == EOS and out[("ign", 0)]["reason"] == "length"
    assert out[("stop_id", 0)]["tokens"] == natural[:2] and out[("stop_id", 0)]["stop_reason"] == natural[1]
    assert out[("len", 0)] == {"tokens": natural[:2], "reason": "length", "cached": 0, "stop_reason": None}
    assert EOS not in out[("min", 0)]["tokens"][: k + 2]
    assert len(out[("min", 0)]["tokens"]) >= k + 2


def test_decodes_continue_every_step_while_a_long_prompt_prefills_in_chunks():
    core = make_core(max_num_batched_tokens=40, chunked_prefill_size=32)
    for i in range(4):
        add(core, f"d{i}", [50 + i] * 10, max_tokens=100, ignore_eos=True)
    run_steps = [core.step() for _ in range(3)]
    assert all(len(d) == 4 for d in run_steps[1:])
    add(core, "long", [60] * 1000, max_tokens=2, ignore_eos=True)
    for _ in range(10):
        deltas = core.step()
        assert sorted(d.request_id for d in deltas if d.new_token_ids)[:4] == ["d0", "d1", "d2", "d3"]
        b = core.runner.batches[-1]
        assert b.extend_lens_cpu[:4] == [1, 1, 1, 1] and b.extend_lens_cpu[4] == 32
    for i in range(4):
        core.abort_request(f"d{i}")
    run(core)
    core.check_no_leak()


@pytest.mark.parametrize("decoders,prefill", [(4, 20), (20, 6)])
def test_a_step_with_decodes_caps_its_prefill_at_mixed_step_tokens(decoders, prefill):
    """--mixed-step-tokens 24: with decode rows the step holds at most 24 tokens, prefill at least a quarter
    (6); with no decodes left, the long prompt takes full chunks again, and its tokens are unchanged."""
    core = make_core(max_num_batched_tokens=64, chunked_prefill_size=48, mixed_step_tokens=24,
                     max_running_requests=32)
    for i in range(decoders):
        add(core, f"d{i}", [50 + i] * 10, max_tokens=20, ignore_eos=True)
    while core.runner.batches[-1:] == [] or core.runner.batches[-1].extend_lens_cpu != [1] * decoders:
        core.step()  # until every short prompt is in and decoding
    add(core, "long", [60] * 1500, max_tokens=3, ignore_eos=True)
    first = len(core.runner.batches)
    out = run(core)
    steps = [b.extend_lens_cpu for b in core.runner.batches[first:]]
    assert steps[0] == [1] * decoders + [prefill]
    mixed = [s for s in steps if 1 in s and max(s) > 1]
    assert mixed and all(sum(s) <= max(24, s.count(1) + 6) for s in mixed)
    assert [48] in steps  # decoders done: full chunks again
    assert out[("long", 0)]["tokens"] == fake_greedy([60] * 1500, 3)


def test_batch_is_request_major_with_logits_only_for_finished_chunks():
    core = make_core(max_num_batched_tokens=100, chunked_prefill_size=60)
    add(core, "a", [70] * 100, max_tokens=3, ignore_eos=True)
    add(core, "b", [71] * 20, max_tokens=3, ignore_eos=True)
    core.step()
    b = core.runner.batches[-1]
    assert b.extend_lens_cpu == [60, 20] and b.seq_lens_cpu == [60, 20]
    assert b.logits_indices.tolist() == [79]  # a's chunk is not its prompt's end: no logits
    assert b.req_index.tolist() == [0] * 60 + [1] * 20
    assert b.positions.tolist() == list(range(60)) + list(range(20))
    assert b.out_cache_loc.unique().numel() == 80
    assert b.page_table.shape == (2, 1)


def test_n_samples_and_single_requests_under_preemption_pressure_all_finish_correctly():
    core = make_core(num_pages=5, max_num_batched_tokens=48, chunked_prefill_size=24, max_running_requests=8)
    ps = prompts(6, 30, 140, seed=12)
    for i, p in enumerate(ps):
        add(core, f"r{i}", p, max_tokens=40, ignore_eos=True, n=3 if i % 2 else 1)
    out = run(core, max_steps=20_000)
    for i, p in enumerate(ps):
        expect = fake_greedy(p, 40, ignore_eos=True)
        for k in range(3 if i % 2 else 1):
            assert out[(f"r{i}", k)]["tokens"] == expect, (i, k)
    assert core.stats()["preemptions"] > 0
    core.check_no_leak()


def test_aborting_one_parked_sample_keeps_its_siblings_and_frees_its_reserved_row():
    core = make_core(max_num_batched_tokens=16, chunked_prefill_size=16, max_running_requests=4)
    p = prompts(1, 100, 100, seed=13)[0]
    add(core, "a", p, max_tokens=4, n=3, ignore_eos=True)
    core.step()  # the leader is mid-prompt: samples 1 and 2 are parked, their rows reserved
    assert core.scheduler.reserved_rows == 2
    assert core.abort_request("a", 2)
    assert core.scheduler.reserved_rows == 1
    out = run(core)
    assert out[("a", 2)]["reason"] == "abort"
    assert out[("a", 0)]["tokens"] == out[("a", 1)]["tokens"] == fake_greedy(p, 4, ignore_eos=True)
    core.check_no_leak()


def test_an_n_request_wider_than_the_free_rows_does_not_stall_the_queue():
    """Issue 20.2: n=4 on 4 rows while one row is busy used to wait for all 4 rows, and everything behind
    it waited too. Its samples now take rows as they free; the request behind it runs long before the
    busy row's request ends, and every output is still right."""
    core = make_core(max_running_requests=4)
    long_p, big_p, small_p = prompts(3, 70, 70, seed=21)
    add(core, "long", long_p, max_tokens=60, ignore_eos=True)
    out: dict = {}
    collect(core.step(), out)
    add(core, "big", big_p, max_tokens=5, n=4, ignore_eos=True)
    add(core, "small", small_p, max_tokens=1, ignore_eos=True)
    steps = 0
    while out.get(("small", 0), {}).get("reason") is None:
        collect(core.step(), out)
        steps += 1
        assert core.stats()["num_running"] + core.scheduler.reserved_rows <= 4
    assert out.get(("long", 0), {}).get("reason") is None  # "small" did not wait for "long" to end
    assert steps < 20, steps
    run(core, out=out)
    assert [out[("big", i)]["tokens"] for i in range(4)] == [fake_greedy(big_p, 5, ignore_eos=True)] * 4
    assert out[("small", 0)]["tokens"] == fake_greedy(small_p, 1, ignore_eos=True)
    assert out[("long", 0)]["tokens"] == fake_greedy(long_p, 60, ignore_eos=True)
    core.check_no_leak()
