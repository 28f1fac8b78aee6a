"""SamplingParams and EngineArgs validation: errors name the field / flag."""

from __future__ import annotations

import argparse

import pytest

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.engine_args import EngineArgs


@pytest.mark.parametrize("kw, field", [
    ({"n": 0}, "n"), ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"min_p": 2.0}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"), ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": -1}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"), ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": "1"}, "seed"),
    ({"ignore_eos": 1}, "ignore_eos"),
])
def test_invalid_sampling_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        SamplingParams(**kw)


def test_stop_string_is_normalised_and_samples_get_consecutive_seeds():
    sp = SamplingParams(n=3, seed=7, stop="END")
    assert sp.stop == ["END"]
    assert [sp.for_sample(i).seed for i in range(3)] == [7, 8, 9]
    assert sp.for_sample(2).n == 1


def test_dict_round_trip_and_unknown_keys_are_rejected():
    sp = SamplingParams(temperature=0.5, stop=["a"], logprobs=3)
    assert SamplingParams.from_dict(sp.to_dict()) == sp
    with pytest.raises(ValueError, match="^bogus:"):
        SamplingParams.from_dict({"bogus": 1})


@pytest.mark.parametrize("kw, flag", [
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens"), ({"num_pages": -1}, "--num-pages"),
    ({"kv_layout": "int4"}, "--kv-layout"), ({"dtype": "float64"}, "--dtype"), ({"device": "tpu"}, "--device"),
    ({"chunked_prefill_size": 4096, "max_num_batched_tokens": 2048}, "--chunked-prefill-size"),
    ({"num_pages": 4, "kv_cache_bytes": 1 << 20}, "--num-pages"), ({"max_running_requests": 0},
                                                                   "--max-running-requests"),
    ({"mem_fraction_static": 1.5}, "--mem-fraction-static"), ({"enable_prefix_caching": "yes"},
                                                              "--enable-prefix-caching"),
])
def test_invalid_engine_args_name_the_flag(kw, flag):
    with pytest.raises(ValueError, match=f"^{flag}"):
        EngineArgs(**kw)


def test_unknown_engine_argument_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown engine argument 'max_num_seqs'.*max_running_requests"):
        EngineArgs.from_kwargs(max_num_seqs=4)


def test_cli_flags_round_trip_into_engine_args():
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--model", "x", "--num-pages", "9", "--no-enable-prefix-caching", "--kv-layout", "bf16",
                       "--mem-fraction-static", "0.5"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.model, args.num_pages, args.enable_prefix_caching, args.kv_layout, args.mem_fraction_static) == (
        "x", 9, False, "bf16", 0.5)
    assert args.chunk_size == args.max_num_batched_tokens
