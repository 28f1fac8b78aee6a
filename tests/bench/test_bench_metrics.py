"""`bench serve` without a server: metric definitions on hand-computed timestamps, the seeded datasets'
documented length distributions, the table format, and the client's chunk counting on scripted streams
(httpx MockTransport): empty text is never a failure; errors are."""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics

import httpx
import pytest

from dsaserve.bench import datasets, report
from dsaserve.bench.client import payload, send
from dsaserve.bench.datasets import BenchRequest, make_requests, sharegpt_like_lengths
from dsaserve.bench.metrics import Record, itls, percentile, stats, summarize, tpot


# ---- metrics --------------------------------------------------------------------------------------
def test_itl_gives_each_token_of_a_chunk_an_equal_share_of_its_gap():
    assert itls([(0.1, 1), (0.3, 1), (0.6, 3)]) == pytest.approx([0.2, 0.1, 0.1, 0.1])
    assert itls([(0.5, 2)]) == [] and itls([]) == []


def test_tpot_is_the_time_after_the_first_token_over_the_tokens_after_it():
    assert tpot(0.1, 0.7, 5) == pytest.approx(0.15)
    assert tpot(0.1, 0.7, 1) is None and tpot(None, 0.7, 5) is None


def test_percentile_interpolates_linearly_as_numpy():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    assert percentile([], 50) == 0.0


def test_stats_are_milliseconds_under_vllm_keys():
    assert stats("ttft", [0.001, 0.003], [99.0]) == pytest.approx(
        {"mean_ttft_ms": 2.0, "median_ttft_ms": 2.0, "std_ttft_ms": 1.0, "p99_ttft_ms": 2.98})


def test_summarize_counts_only_successful_requests():
    a = Record(input_len=10, expected_output=4, ok=True, chunks=[(0.1, 1), (0.2, 1), (0.4, 2)], output_tokens=4,
               e2el=0.5)
    b = Record(input_len=20, expected_output=2, ok=True, chunks=[(0.3, 1), (0.4, 1)], output_tokens=2, e2el=0.4)
    bad = Record(input_len=99, expected_output=2, error="HTTP 500: boom")
    s = summarize([a, b, bad], 2.0, [50.0])
    assert (s["completed"], s["failed"], s["total_input_tokens"], s["total_output_tokens"]) == (2, 1, 30, 6)
    assert (s["request_throughput"], s["output_throughput"], s["total_token_throughput"]) == (1.0, 3.0, 18.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_e2el_ms"] == pytest.approx(450.0)
    # TPOT: a (0.5 - 0.1) / 3, b (0.4 - 0.3) / 1; ITL: a 0.1, 0.1, 0.1 and b 0.1
    assert s["mean_tpot_ms"] == pytest.approx((400 / 3 + 100) / 2)
    assert s["mean_itl_ms"] == pytest.approx(100.0) and s["p50_itl_ms"] == pytest.approx(100.0)
    assert s["errors"] == ["", "", "HTTP 500: boom"] and s["output_lens"] == [4, 2, 0]


# ---- datasets -------------------------------------------------------------------------------------
def test_random_dataset_lengths_and_ids():
    reqs = make_requests("random", 200, input_len=100, output_len=20, range_ratio=0.5, vocab=512, as_text=False,
                         seed=3)
    assert all(50 <= r.input_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert all(len(r.prompt) == r.input_len and min(r.prompt) >= datasets.FIRST_ID and max(r.prompt) < 512
               for r in reqs)
    assert min(r.input_len for r in reqs) < 60 and max(r.input_len for r in reqs) > 140  # spread over the range
    again = make_requests("random", 200, input_len=100, output_len=20, range_ratio=0.5, vocab=512, as_text=False,
                          seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    fixed = make_requests("random", 5, input_len=7, output_len=3, range_ratio=0.0, vocab=512, as_text=False, seed=0)
    assert {(r.input_len, r.output_len) for r in fixed} == {(7, 3)}


def test_sharegpt_like_lengths_are_as_documented():
    lengths = sharegpt_like_lengths(40000, random.Random(0))
    ins, outs = [i for i, _ in lengths], [o for _, o in lengths]
    # the figures datasets.py's docstring quotes
    assert (round(statistics.mean(ins)), round(statistics.mean(outs))) == (157, 340)
    assert (statistics.median(ins), statistics.median(outs)) == (97, 235)
    assert all(4 <= i <= 1024 and o >= 4 and i + o <= 2048 for i, o in lengths)  # vLLM's ShareGPT filter
    # log-normal: the log-lengths' spread is the documented sigma (a little less: the filter cuts the tails)
    assert statistics.pstdev(map(math.log, ins)) == pytest.approx(datasets.SHAREGPT_INPUT_SIGMA, rel=0.1)
    assert statistics.pstdev(map(math.log, outs)) == pytest.approx(datasets.SHAREGPT_OUTPUT_SIGMA, rel=0.1)
    reqs = make_requests("sharegpt-like", 50, input_len=1, output_len=1, range_ratio=0.0, vocab=512, as_text=False,
                         seed=0, fixed_output_len=2)
    assert [r.input_len for r in reqs] == [i for i, _ in sharegpt_like_lengths(50, random.Random(0))]
    assert {r.output_len for r in reqs} == {2}


# ---- report ---------------------------------------------------------------------------------------
def test_table_is_vllm_format_and_carries_the_json_numbers():
    a = Record(input_len=10, expected_output=3, ok=True, chunks=[(0.1, 1), (0.25, 2)], output_tokens=3, e2el=0.3)
    s = summarize([a], 1.5, [90.0, 99.0]) | {"max_concurrency": 4, "request_rate": float("inf")}
    text = report.format_table(s, [90.0, 99.0])
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============" and lines[-1] == "=" * 50
    assert "---------------Time to First Token----------------" in lines
    assert "Successful requests:                     1         " in lines
    parsed = report.parse_table(text)
    for label, key, fmt in report.table_rows(s, [90.0, 99.0]):
        if label:
            assert parsed[label] == float(format(s[key], fmt)), label
    assert parsed["P90 ITL (ms):"] == 75.0


def test_json_is_strict(tmp_path):
    path = tmp_path / "r.json"
    report.write_json(path, {"request_rate": float("inf"), "x": [1.5, None]})
    assert json.loads(path.read_text(), parse_constant=pytest.fail) == {"request_rate": "inf", "x": [1.5, None]}


# ---- client on scripted streams -------------------------------------------------------------------
def _sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


def _run(body: bytes, status: int = 200, token_counts: str = "logprobs") -> Record:
    async def go() -> Record:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            req = BenchRequest([7, 8, 9], 3, 3)
            return await send(client, "http://x/v1/completions", payload(req, "m", "completions", token_counts, True),
                              req, {})
    return asyncio.run(go())


USAGE = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}


def _choice(text: str, tokens: list[str] | None = None) -> dict:
    c = {"index": 0, "text": text}
    if tokens is not None:
        c["logprobs"] = {"tokens": tokens}
    return {"choices": [c]}


def test_tokens_with_empty_text_count_and_do_not_fail():
    rec = _run(_sse(_choice("", ["bytes:\\xca"]), _choice("", ["bytes:\\x9a"]), _choice("", ["x", "y"]), USAGE,
                    b"[DONE]"))
    assert rec.ok and rec.error == "" and rec.output_tokens == 3 and rec.input_len == 3
    assert [k for _, k in rec.chunks] == [1, 1, 2] and rec.empty_text_chunks == 3 and rec.ttft is not None
    # a server that sends neither logprobs nor per-chunk usage, all text empty: not a failure either
    rec = _run(_sse(_choice(""), _choice(""), USAGE, b"[DONE]"))
    assert rec.ok and rec.output_tokens == 3 and rec.chunks == [] and rec.ttft is None


def test_continuous_usage_counts_each_chunks_growth():
    def chunk(text: str, done: int) -> dict:
        return _choice(text) | {"usage": {"prompt_tokens": 3, "completion_tokens": done}}
    rec = _run(_sse(chunk("a", 1), chunk("", 3), USAGE, b"[DONE]"), token_counts="usage")
    assert rec.ok and [k for _, k in rec.chunks] == [1, 2] and rec.output_tokens == 3 and not rec.counted_by_text


def test_text_only_chunks_count_one_token_each_and_say_so():
    rec = _run(_sse(_choice("a"), _choice("b"), USAGE, b"[DONE]"))
    assert rec.ok and rec.counted_by_text and [k for _, k in rec.chunks] == [1, 1] and rec.output_tokens == 3


@pytest.mark.parametrize(("body", "status", "error"), [
    (b'{"error": {"message": "bad"}}', 400, "HTTP 400"),
    (_sse(_choice("a", ["a"]), {"error": {"message": "engine died"}}, b"[DONE]"), 200, "engine died"),
    (_sse(_choice("a", ["a"])), 200, "before [DONE]"),
])
def test_errors_fail_the_request(body, status, error):
    rec = _run(body, status)
    assert not rec.ok and error in rec.error


def test_default_token_counts_are_running_usage_without_logprobs():
    import argparse

    from dsaserve.bench.serve import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--base-url", "u"]).token_counts == "usage"
    req = BenchRequest([7, 8, 9], 3, 3)
    for endpoint in ("completions", "chat"):
        body = payload(req, "m", endpoint, "usage", True)
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert "logprobs" not in body and "top_logprobs" not in body
        lp = payload(req, "m", endpoint, "logprobs", True)
        assert lp["stream_options"]["continuous_usage_stats"] is False and lp["logprobs"] in (0, True)
