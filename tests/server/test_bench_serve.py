"""`dsaserve bench serve` against a real server on the tiny random-weight model: tokens are counted, not text
(its tokens often decode to no text, and no request fails for that); output lengths are as asked with
--ignore-eos; token counts agree with the server's own metrics; TPOT is consistent with E2EL and TTFT; the
table prints the JSON's numbers; the datasets' lengths reach the server; `--first-request` warns about a
server that already served requests and reports first vs steady; `bench step` runs the engine's script."""

from __future__ import annotations

import json

import pytest

from dsaserve.bench import report
from dsaserve.bench.datasets import make_requests
from dsaserve.cli import main
from tests.server.harness import scrape, value, wait_idle

TOKENS = ("dsaserve_generation_tokens_total", "dsaserve_prompt_tokens_total")


def _bench(server, tmp_path, *args: str) -> tuple[int, dict, dict[str, float]]:
    """Run bench serve; (exit code, its JSON, how much each server token counter grew)."""
    wait_idle(server)
    _, before = scrape(server)
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--json", str(out), *args])
    _, after = scrape(server)
    return rc, json.loads(out.read_text()), {k: value(after, k) - value(before, k) for k in TOKENS}


@pytest.mark.parametrize("counts", ["usage", "logprobs"])  # usage (continuous_usage_stats) is the default
def test_bench_serve_counts_tokens_not_text(server, tmp_path, capsys, counts):
    rc, r, grown = _bench(server, tmp_path, "--token-counts", counts, "--num-prompts", "12", "--input-len", "40",
                          "--output-len", "8", "--range-ratio", "0.5", "--max-concurrency", "4", "--request-rate", "50")
    assert rc == 0 and r["completed"] == 12 and r["failed"] == 0 and set(r["errors"]) == {""}
    assert r["empty_text_chunks"] > 0  # random weights: some tokens decode to no text, and they still count
    assert r["output_lens"] == r["max_tokens"] and r["requests_short_of_max_tokens"] == 0  # --ignore-eos
    assert r["requests_counted_by_text"] == 0  # every chunk said how many tokens it carried
    # the client's token counts are the server's
    assert r["total_output_tokens"] == sum(r["max_tokens"]) == grown["dsaserve_generation_tokens_total"]
    assert r["total_input_tokens"] == sum(r["input_lens"]) == grown["dsaserve_prompt_tokens_total"]
    assert all(20 <= n <= 60 for n in r["input_lens"]) and all(4 <= n <= 12 for n in r["max_tokens"])
    for ttft, tpot, e2el, itl, n in zip(r["ttfts"], r["tpots"], r["e2els"], r["itls"], r["output_lens"], strict=True):
        assert 0 < ttft < e2el and tpot >= 0
        assert ttft + tpot * (n - 1) == pytest.approx(e2el)  # TPOT = (E2EL - TTFT) / (tokens - 1)
        assert len(itl) == n - 1 and sum(itl) <= e2el - ttft + 1e-9  # one gap per token after the first
    for metric in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{metric}_ms"] <= r[f"p99_{metric}_ms"], metric
    out = capsys.readouterr().out
    assert "============ Serving Benchmark Result ============" in out
    parsed = report.parse_table(out)
    rows = [(label, key, fmt) for label, key, fmt in report.table_rows(r, [99.0]) if label]
    assert len(rows) == len(parsed) == 22
    for label, key, fmt in rows:  # the table prints the JSON's numbers (an infinite rate is "inf" in JSON)
        number = float(r[key]) if isinstance(r[key], str) else r[key]
        assert parsed[label] == float(format(number, fmt)), label


def test_bench_serve_sharegpt_like_lengths_reach_the_server(server, tmp_path):
    rc, r, grown = _bench(server, tmp_path, "--dataset", "sharegpt-like", "--num-prompts", "4",
                          "--sharegpt-output-len", "2", "--max-concurrency", "2", "--seed", "5")
    vocab = server.get("/startup").json()["scheduler_info"]["vocab_size"]
    sent = make_requests("sharegpt-like", 4, input_len=1, output_len=1, range_ratio=0.0, vocab=vocab,
                         as_text=False, seed=5, fixed_output_len=2)
    assert rc == 0 and r["failed"] == 0 and r["input_lens"] == [q.input_len for q in sent]
    assert r["output_lens"] == [2] * 4
    assert r["total_input_tokens"] == grown["dsaserve_prompt_tokens_total"]


def test_bench_serve_chat_first_request_warns_and_reports(server, tmp_path, capsys):
    assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "1", "--input-len", "4",
                 "--output-len", "2", "--disable-tqdm"]) == 0  # the server has now served a request for sure
    capsys.readouterr()
    rc, r, _ = _bench(server, tmp_path, "--endpoint", "chat", "--first-request", "--num-prompts", "4",
                      "--input-len", "16", "--output-len", "6")
    assert rc == 0 and r["server_requests_before"] >= 1
    err = capsys.readouterr().err
    assert "WARNING: the server has already served" in err
    assert "first request: 16 tokens in, 6 out" in err and "steady requests" in err  # progress as it goes
    assert r["first"]["completed"] == 1 and r["first"]["output_lens"] == [6]
    assert r["steady"]["completed"] == 4 and r["steady"]["total_output_tokens"] == 24
    assert r["ttft_first_over_steady_median"] > 0


def test_bench_serve_counts_failures_instead_of_crashing(server, tmp_path):
    out = tmp_path / "bad.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--model", "no-such-model", "--num-prompts", "3",
               "--input-len", "8", "--output-len", "2", "--json", str(out)])
    r = json.loads(out.read_text())
    assert rc == 1 and r["failed"] == 3 and r["completed"] == 0 and "HTTP 404" in r["errors"][0]


def test_bench_step_runs_the_scheduler_step_script(tmp_path, set_switch):
    script = tmp_path / "bench_scheduler_step.py"
    record = tmp_path / "argv.json"
    script.write_text(f"import json\ndef main(argv):\n    open({str(record)!r}, 'w').write(json.dumps(argv))\n"
                      "    return 0\n")
    set_switch("DSASERVE_BENCH_STEP_SCRIPT", str(script))
    assert main(["bench", "step", "--steps", "5", "--help"]) == 0
    assert json.loads(record.read_text()) == ["--steps", "5", "--help"]
    script.write_text(f"import json, sys\ndef main():\n"
                      f"    open({str(record)!r}, 'w').write(json.dumps(sys.argv[1:]))\n")
    assert main(["bench", "step", "--batches", "1"]) == 0  # a main() that reads sys.argv gets the arguments
    assert json.loads(record.read_text()) == ["--batches", "1"]
    set_switch("DSASERVE_BENCH_STEP_SCRIPT", str(tmp_path / "missing.py"))
    assert main(["bench", "step"]) == 2
