"""The offline Engine on the fake runner: prompts, text, stop strings, streaming, n > 1, abort, logprobs."""

from __future__ import annotations

import pytest

from dsaserve import Engine, SamplingParams
from tests.engine.fake_runner import EOS, FakeRunner, fake_greedy


def engine(num_pages: int = 64, **kw) -> Engine:
    return Engine(runner=FakeRunner(num_pages=num_pages), **kw)


def text_of(ids: list[int]) -> str:
    return "".join(chr(t) for t in ids if t >= 32)


def test_text_and_token_prompts_in_one_batch_come_back_in_order():
    eng = engine()
    outs = eng.generate(["hello", [104, 101, 108, 108, 111], "abc"], SamplingParams(temperature=0, max_tokens=12))
    assert outs[0].token_ids == outs[1].token_ids == fake_greedy([104, 101, 108, 108, 111], 12)
    assert outs[0].prompt == "hello" and outs[1].prompt is None
    assert outs[2].token_ids == fake_greedy([97, 98, 99], 12)
    for o in outs:
        assert o.text == text_of(o.token_ids)
        assert o.finish_reason in ("stop", "length")
    eng.core.check_no_leak()


def test_stop_string_spanning_tokens_is_trimmed_and_ends_the_request():
    p = "the prompt"
    full = text_of(fake_greedy([ord(c) for c in p], 40, ignore_eos=True))
    stop = full[10:13]
    i = full.index(stop)
    eng = engine()
    out = eng.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"]))[0]
    assert out.text == full[:i] and out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert len(out.token_ids) == i + len(stop)  # generation stopped at the token that completed the stop string
    keep = eng.generate(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stop,
                                          include_stop_str_in_output=True))[0]
    assert keep.text == full[: i + len(stop)]
    eng.core.check_no_leak()


def test_eos_is_not_part_of_the_text():
    prompt = next([ord(c) for c in f"p{i}"] for i in range(500) if EOS in fake_greedy([ord(c) for c in f"p{i}"], 20))
    out = engine().generate([prompt], SamplingParams(temperature=0, max_tokens=20))[0]
    assert out.token_ids[-1] == EOS and out.finish_reason == "stop"
    assert out.text == text_of(out.token_ids[:-1])


def test_streamed_deltas_reassemble_to_the_generated_output():
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["~~~~"])
    prompts = ["stream one", "stream two"]
    full = engine().generate(prompts, params)
    texts = {}
    ids = {}
    for o in engine().stream(prompts, params):
        c = o.outputs[0]
        texts[o.request_id] = texts.get(o.request_id, "") + c.delta_text
        ids[o.request_id] = ids.get(o.request_id, []) + c.delta_token_ids
    assert sorted(texts.values()) == sorted(o.text for o in full)
    assert sorted(ids.values()) == sorted(o.token_ids for o in full)


def test_n_samples_come_back_as_outputs_of_one_request():
    out = engine().generate("fork", SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 and o.text == text_of(o.token_ids) for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3


def test_a_stop_string_ends_only_its_own_sample():
    eng = engine()
    p = "sample"
    greedy = text_of(fake_greedy([ord(c) for c in p], 20, ignore_eos=True))
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True, stop=greedy[3:5])
    out = eng.generate(p, params)[0]
    assert [o.text for o in out.outputs] == [greedy[:3]] * 2
    eng.core.check_no_leak()


def test_abort_from_a_stream_ends_the_request_with_abort_and_frees_pages():
    eng = engine()
    stream = eng.stream(["a long one"], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    first = next(stream)
    assert eng.abort(first.request_id)
    last = list(stream)[-1]
    assert last.finished and last.finish_reason == "abort"
    eng.core.check_no_leak()


def test_closing_a_stream_early_aborts_what_is_left():
    eng = engine()
    stream = eng.stream(["x", "y"], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(stream)
    stream.close()
    assert not eng.has_unfinished()
    eng.core.check_no_leak()


def test_logprobs_arrive_one_per_token():
    out = engine().generate("lp", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2))[0]
    assert len(out.logprobs) == 5
    for tok, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp["top"][0][0] == tok and len(lp["top"]) == 2 and lp["logprob"] == lp["top"][0][1]


def test_a_bad_prompt_in_a_batch_rejects_the_batch_and_leaves_nothing_behind():
    eng = engine(num_pages=2)
    with pytest.raises(ValueError, match="max_req_input_len"):
        eng.generate(["ok", [40] * 200], SamplingParams(max_tokens=1))
    assert not eng.has_unfinished()
    assert eng.generate("ok", SamplingParams(temperature=0, max_tokens=3))[0].token_ids == fake_greedy([111, 107], 3)


def test_engine_args_are_validated_by_name():
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        engine(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="unknown engine argument 'max_num_seqs'"):
        engine(max_num_seqs=3)


def test_kv_pool_info_names_a_runner_without_a_pool():
    with pytest.raises(RuntimeError, match="FakeRunner"):
        engine().kv_pool_info()


def test_stop_token_ids_outside_the_vocabulary_are_rejected_and_the_engine_keeps_serving():
    eng = engine()
    with pytest.raises(ValueError, match="^stop_token_ids"):
        eng.generate("x", SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=[10**9]))
    assert eng.generate("ok", SamplingParams(temperature=0, max_tokens=3))[0].token_ids == fake_greedy([111, 107], 3)


def test_seed_plus_n_must_stay_a_valid_seed():
    with pytest.raises(ValueError, match="^seed"):
        SamplingParams(n=2, seed=2**63 - 1).validate()


@pytest.mark.parametrize("steps_before_abort", [0, 1])
def test_aborting_an_n_request_before_its_samples_fork_frees_everything(steps_before_abort):
    eng = engine()
    rid = eng.add_request([7] * 150, SamplingParams(n=3, temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(steps_before_abort):
        eng.step()
    assert eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    eng.core.check_no_leak()
