"""Overlap scheduling (engine/overlap.py) on the CPU, where it is off by default and forced on here: every
scenario runs twice, synchronously and overlapped, and must give identical greedy / seeded tokens, finish
reasons, stop reasons, usage (prompt, cached and completion tokens) and logprobs, with no page left behind.
The fake runner (tests/engine/fake_runner.py) reads its KV back through the page table and resolves the
placeholder input ids from `future_token_ids` as the real runner does, so a token fed to the wrong row, or a
page freed while still needed, changes the output or raises."""

from __future__ import annotations

import json
import random
from collections.abc import Callable

import pytest
import torch

from dsaserve import Engine, SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.overlap import resolve_placeholders_
from dsaserve.engine.request import EngineRequest, placeholder
from tests.engine.fake_runner import EOS, FakeRunner, fake_greedy, prompts

Outputs = dict[tuple[str, int], dict]


def make_core(overlap: bool, num_pages: int = 64, context: int = 4096, vocab: int = 128, **kw) -> EngineCore:
    runner = FakeRunner(num_pages=num_pages, max_position_embeddings=context, vocab=vocab)
    core = EngineCore(EngineArgs(disable_overlap_schedule=not overlap, **kw), runner=runner)
    assert core.overlap is overlap
    return core


def add(core: EngineCore, rid: str, prompt: list[int], **sp) -> None:
    core.add_request(EngineRequest(rid, prompt, SamplingParams(**{"temperature": 0.0, **sp})))


def collect(deltas, out: Outputs) -> None:
    """Per (request, sample): what a client sees — tokens, logprobs, finish, and the usage numbers."""
    for d in deltas:
        o = out.setdefault((d.request_id, d.index), {"tokens": [], "logprobs": [], "reason": None})
        assert o["reason"] is None, f"a delta after the finish of {d.request_id}#{d.index}"
        assert all(t >= 0 for t in d.new_token_ids), "a placeholder reached a delta"
        o["tokens"] += d.new_token_ids
        o["logprobs"] += d.new_logprobs or []
        o["usage"] = (d.prompt_tokens, d.cached_tokens)
        if d.finished:
            o["reason"], o["stop_reason"] = d.finish_reason, d.stop_reason


def run(core: EngineCore, out: Outputs | None = None, max_steps: int = 20_000) -> Outputs:
    out = {} if out is None else out
    for _ in range(max_steps):
        if not core.has_unfinished():
            return out
        collect(core.step(), out)
    raise AssertionError(f"not finished after {max_steps} steps: {core.stats()}")


def both(scenario: Callable[[EngineCore], Outputs], **core_kw) -> tuple[Outputs, EngineCore]:
    """The scenario synchronously and overlapped: identical outputs, nothing leaked, and the overlapped run
    really launched steps ahead of their predecessor's tokens. Returns the outputs and the overlapped core."""
    sync_core, overlap_core = make_core(False, **core_kw), make_core(True, **core_kw)
    sync_out, overlap_out = scenario(sync_core), scenario(overlap_core)
    for core in (sync_core, overlap_core):
        core.check_no_leak()
    assert overlap_out == sync_out
    s = overlap_core.stats()
    assert s["overlap_steps"] > 0 and sync_core.stats()["overlap_steps"] == 0
    # usage never counts a discarded token: generated = what the deltas carried
    assert s["generation_tokens"] == sum(len(o["tokens"]) for o in overlap_out.values())
    return sync_out, overlap_core


def test_placeholders_become_the_sampled_tokens_on_the_device():
    future = torch.tensor([70, 71, 72])
    ids = torch.tensor([5, placeholder(0), placeholder(2), 0, placeholder(1)])
    resolve_placeholders_(ids, future)
    assert ids.tolist() == [5, 70, 72, 0, 71]


def test_arrivals_chunked_prefill_and_every_finish_reason_match_the_synchronous_engine():
    ps = prompts(30, 1, 200, seed=1)

    def scenario(core: EngineCore) -> Outputs:
        out: Outputs = {}
        for i, p in enumerate(ps):  # three arrive per step while earlier ones prefill and decode
            sp: dict = {"max_tokens": random.Random(i).randrange(1, 40)}
            if i % 4 == 1:
                sp["stop_token_ids"] = [fake_greedy(p, 3, ignore_eos=True)[2]]
            if i % 4 == 2:
                sp.update(min_tokens=min(5, sp["max_tokens"]), logprobs=2)
            if i % 4 == 3:
                sp["ignore_eos"] = True
            add(core, f"r{i}", p, **sp)
            if i % 3 == 2:
                collect(core.step(), out)
        return run(core, out)

    out, core = both(scenario, num_pages=48, max_num_batched_tokens=96, chunked_prefill_size=40,
                     max_running_requests=16)
    reasons = {o["reason"] for o in out.values()}
    assert reasons == {"stop", "length"}
    assert any(o.get("stop_reason") is not None for o in out.values())  # a stop token id ended one
    assert out[("r0", 0)]["tokens"] == fake_greedy(ps[0], len(out[("r0", 0)]["tokens"]))
    assert core.stats()["overlap_discarded_tokens"] > 0  # rows that had finished one step before


@pytest.mark.parametrize("caching", [True, False])
def test_preemption_with_n_samples_matches_the_synchronous_engine(caching):
    ps = prompts(6, 30, 140, seed=12)

    def scenario(core: EngineCore) -> Outputs:
        for i, p in enumerate(ps):
            add(core, f"r{i}", p, max_tokens=40, ignore_eos=i % 3 != 0, n=3 if i % 2 else 1)
        return run(core)

    out, core = both(scenario, num_pages=5, max_num_batched_tokens=48, chunked_prefill_size=24,
                     max_running_requests=8, enable_prefix_caching=caching)
    assert core.stats()["preemptions"] > 0
    assert out[("r1", 2)]["tokens"] == fake_greedy(ps[1], 40, ignore_eos=True)


def test_a_sample_preempted_while_its_last_token_is_on_the_way_finishes_from_the_waiting_queue():
    """Three pages: "a" fills two and needs a third for its first decode, "b" holds the third and has just
    sampled its only token. Synchronously "b" has finished and left; overlapped, it is still running when
    step 2 is scheduled, so it is preempted, and then its token ends it in the waiting queue."""
    a, b = prompts(1, 128, 128, seed=40)[0], prompts(1, 60, 60, seed=41)[0]

    def scenario(core: EngineCore) -> Outputs:
        add(core, "a", a, max_tokens=4, ignore_eos=True)
        add(core, "b", b, max_tokens=1, ignore_eos=True)
        return run(core)

    out, core = both(scenario, num_pages=3)
    assert out[("b", 0)]["reason"] == "length" and out[("a", 0)]["tokens"] == fake_greedy(a, 4, ignore_eos=True)
    assert core.stats()["preemptions"] == 1 and not core.scheduler.waiting


def test_prefix_cache_hits_report_the_same_cached_tokens():
    shared = prompts(1, 200, 200, seed=3)[0]

    def scenario(core: EngineCore) -> Outputs:
        add(core, "a", shared, max_tokens=5, ignore_eos=True)
        out = run(core)
        add(core, "b", shared + [65, 66, 67], max_tokens=70, ignore_eos=True)  # its output crosses a page
        add(core, "c", shared[:130], max_tokens=3, ignore_eos=True)
        return run(core, out)

    out, _ = both(scenario)
    assert out[("b", 0)]["usage"] == (203, 192) and out[("c", 0)]["usage"] == (130, 128)


def test_seeded_sampling_filters_penalties_and_n_samples_match():
    p = prompts(1, 70, 70, seed=8)[0]

    def scenario(core: EngineCore) -> Outputs:
        add(core, "a", p, max_tokens=12, n=3, temperature=1.5, seed=11, top_k=20, top_p=0.9, ignore_eos=True)
        add(core, "b", p[:40], max_tokens=12, temperature=0.7, seed=3, repetition_penalty=1.3,
            frequency_penalty=0.5, presence_penalty=0.2, logprobs=3)
        add(core, "c", p[:20], max_tokens=12, temperature=1.0, seed=5, min_p=0.1, min_tokens=4)
        return run(core)

    out, _ = both(scenario)
    assert len({tuple(out[("a", i)]["tokens"]) for i in range(3)}) == 3
    assert len(out[("b", 0)]["logprobs"]) == len(out[("b", 0)]["tokens"])


def test_a_request_reaching_the_context_is_not_scheduled_past_it():
    p = prompts(1, 150, 150, seed=4)[0]

    def scenario(core: EngineCore) -> Outputs:
        add(core, "ctx", p, max_tokens=None, ignore_eos=True)  # no max_tokens: it runs to the 200-token context
        add(core, "other", p[:50], max_tokens=60, ignore_eos=True)
        return run(core)

    out, core = both(scenario, context=192)  # the context is three full pages
    assert out[("ctx", 0)]["reason"] == "length" and len(out[("ctx", 0)]["tokens"]) == 42
    assert max(max(b.seq_lens_cpu) for b in core.runner.batches) <= 192


def test_an_abort_frees_the_pages_at_once_and_the_token_on_its_way_is_never_reported():
    """The owner aborts a sample once it has seen k tokens of it (as a stop string does). Overlapped, the
    engine had already launched the next token: it is dropped, so the output is the same k tokens."""
    ps = prompts(4, 60, 90, seed=6)
    cut = {"r0": 3, "r1": 1, "r2": 17, "r3": 40}

    def scenario(core: EngineCore) -> Outputs:
        out: Outputs = {}
        for i, p in enumerate(ps):
            add(core, f"r{i}", p, max_tokens=30 if i != 3 else 20, ignore_eos=True, logprobs=1)
        while core.has_unfinished():
            deltas = core.step()
            collect(deltas, out)
            for d in deltas:
                o = out[(d.request_id, 0)]
                if o["reason"] is None and len(o["tokens"]) >= cut[d.request_id]:
                    used = core.stats()["kv_pages_used"]
                    assert core.abort_request(d.request_id)
                    assert core.stats()["kv_pages_used"] < used  # freed on return, not a step later
        return out

    out, core = both(scenario)
    for i, p in enumerate(ps):
        o = out[(f"r{i}", 0)]
        if o["reason"] == "abort":
            assert o["tokens"] == fake_greedy(p, cut[f"r{i}"], ignore_eos=True)
            assert len(o["logprobs"]) == cut[f"r{i}"]
    assert {o["reason"] for o in out.values()} == {"abort", "length"}
    assert core.stats()["overlap_discarded_tokens"] > 0


def test_an_abort_is_reported_by_the_next_step():
    core = make_core(True)
    add(core, "a", prompts(1, 30, 30)[0], max_tokens=50, ignore_eos=True)
    add(core, "b", prompts(1, 30, 30, seed=1)[0], max_tokens=50, ignore_eos=True)
    for _ in range(4):
        core.step()
    assert core.abort_request("a")
    deltas = core.step()
    assert [(d.request_id, d.finish_reason) for d in deltas if d.finished] == [("a", "abort")]
    assert all(d.request_id == "b" for d in core.step())
    core.abort_request("b")
    run(core)
    core.check_no_leak()


def test_the_tokens_of_a_step_are_reported_by_the_next_one():
    """What overlap means at the API: step() launches a forward and returns the step before's tokens."""
    core = make_core(True)
    add(core, "a", [40, 41, 42], max_tokens=3, ignore_eos=True)
    assert core.step() == []  # prefill launched; its token is still on its way
    first = core.step()  # decode 1 launched; the prefill's token arrives
    assert [d.new_token_ids for d in first] == [fake_greedy([40, 41, 42], 1, ignore_eos=True)]
    assert core.runner.batches[-1].input_ids.tolist() == first[0].new_token_ids  # fed back on the "device"
    out: Outputs = {}
    collect(first, out)
    run(core, out)
    assert out[("a", 0)]["tokens"] == fake_greedy([40, 41, 42], 3, ignore_eos=True)
    # the last token fed back is the second; the third ends the request by max_tokens, known on the host
    # without its value: no fourth forward was launched
    assert core.stats()["computed_tokens"] == 3 + 2 and core.stats()["overlap_discarded_tokens"] == 0


def test_the_offline_engine_with_stop_strings_and_streaming_matches():
    p = "the prompt"
    full = "".join(chr(t) for t in fake_greedy([ord(c) for c in p], 40, ignore_eos=True) if t >= 32)
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[full[10:13]]),
              SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True, stop=full[3:5]),
              SamplingParams(temperature=0.8, seed=1, max_tokens=30, logprobs=2)]
    results = []
    for overlap in (False, True):
        eng = Engine(runner=FakeRunner(), disable_overlap_schedule=not overlap)
        outs = eng.generate([p, p, "x" + p], params)
        streamed = [o.outputs[0].delta_text for o in eng.stream(p, params[0])]
        results.append(([(c.text, c.token_ids, c.finish_reason, c.stop_reason, c.logprobs)
                         for o in outs for c in o.outputs], "".join(streamed)))
        eng.core.check_no_leak()
    assert results[0] == results[1]
    assert results[1][0][0][0] == full[: full.index(full[10:13])]


def test_unseeded_sampling_draws_the_same_noise_when_samples_finish_on_a_stop_token():
    """A sample that ended at step N is still in step N+1's batch; it is not sampled, so the shared
    generator draws for exactly the rows the synchronous engine has."""
    ps = prompts(8, 5, 30, seed=30)

    def scenario(core: EngineCore) -> Outputs:
        for i, p in enumerate(ps):
            add(core, f"r{i}", p, max_tokens=40, temperature=1.0)
        return run(core)

    out, core = both(scenario)
    assert sum(o["reason"] == "stop" for o in out.values()) >= 2
    assert core.stats()["overlap_discarded_tokens"] > 0


def test_eos_first_token_and_one_token_requests():
    p = next([ord(c) for c in f"p{i}"] for i in range(2000) if fake_greedy([ord(c) for c in f"p{i}"], 1) == [EOS])

    def scenario(core: EngineCore) -> Outputs:
        add(core, "eos", p, max_tokens=10)
        add(core, "one", p, max_tokens=1, ignore_eos=True)
        add(core, "n", p, max_tokens=5, n=2, ignore_eos=True)
        return run(core)

    out, _ = both(scenario)
    assert out[("eos", 0)]["tokens"] == [EOS] and out[("eos", 0)]["reason"] == "stop"


def test_grammar_requests_match_and_stay_valid():
    """The bitmask of step N+1 needs step N's token in the matcher: resolved before N+1 is sampled."""
    import jsonschema

    from dsaserve.config import load_config
    from dsaserve.engine.grammar import make_spec
    from dsaserve.weights.tokenizer_builder import build_tokenizer

    tok = build_tokenizer(load_config("glm-5.3-tiny"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}},
              "required": ["a", "b"], "additionalProperties": False}
    spec = make_spec("json_schema", schema).to_dict()

    def scenario(core: EngineCore) -> Outputs:
        core.runner.tokenizer = tok
        add(core, "g", [40, 41], max_tokens=60, n=2, temperature=1.0, seed=2, structured_outputs=spec, logprobs=1)
        add(core, "r", [42], max_tokens=30, temperature=0.5, seed=1, structured_outputs=make_spec(
            "regex", "[a-c]{3,9}").to_dict(), min_tokens=2)
        add(core, "free", [43, 44], max_tokens=30, ignore_eos=True)
        return run(core)

    out, _ = both(scenario, vocab=520)
    for i in range(2):
        assert out[("g", i)]["reason"] == "stop"
        jsonschema.validate(json.loads(tok.decode(out[("g", i)]["tokens"][:-1])), schema)


def test_the_model_runner_feeds_its_samples_back_on_the_device():
    """The real runner on the CPU reference path: placeholder ids resolved from its `future_token_ids`."""
    prompts_ = [[5, 6, 7, 8] * 5, [11, 12, 13] * 7]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)]
    outs = []
    for overlap in (False, True):
        eng = Engine("glm-5.3-tiny", device="cpu", num_pages=32, disable_overlap_schedule=not overlap)
        assert (eng.core.runner.future_token_ids is not None) is overlap and eng.core.overlap is overlap
        outs.append([(c.token_ids, c.logprobs) for o in eng.generate(prompts_, params) for c in o.outputs])
        eng.core.check_no_leak()
    assert outs[0] == outs[1]


def test_the_flag_defaults_to_the_device():
    assert EngineArgs(device="cuda").overlap_schedule and not EngineArgs(device="cpu").overlap_schedule
    assert EngineArgs(device="cpu", disable_overlap_schedule=False).overlap_schedule
    assert not EngineArgs(device="cuda", disable_overlap_schedule=True).overlap_schedule
    with pytest.raises(ValueError, match="--disable-overlap-schedule"):
        EngineArgs(disable_overlap_schedule="yes")
    # by default the engine core follows where its runner's `future_token_ids` live: a CPU runner steps
    # synchronously even on a GPU machine, and a runner without the buffer always does
    assert not EngineCore(EngineArgs(), runner=FakeRunner()).overlap
    runner = FakeRunner()
    del runner.future_token_ids
    assert not EngineCore(EngineArgs(disable_overlap_schedule=False), runner=runner).overlap
