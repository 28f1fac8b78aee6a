"""`dsaserve bench serve` against a real server: counts agree with the server's own metrics; percentiles are
ordered; `--first-request` reports first vs steady; `bench step` runs the engine's script."""

from __future__ import annotations

import json

from dsaserve.cli import main
from tests.server.harness import scrape, value, wait_idle


def test_bench_serve_reports_latencies_and_throughput(server, tmp_path, capsys):
    wait_idle(server)
    _, before = scrape(server)
    out = tmp_path / "bench.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "12", "--input-len", "40",
               "--output-len", "8", "--random-range-ratio", "0.5", "--max-concurrency", "4",
               "--request-rate", "50", "--json", str(out)])
    assert rc == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    r = json.loads(out.read_text())
    _, after = scrape(server)
    assert r["completed"] == 12 and r["failed"] == 0
    # the client's token counts are the server's
    assert r["total_output_tokens"] == value(after, "dsaserve_generation_tokens_total") - \
        value(before, "dsaserve_generation_tokens_total")
    assert r["total_input_tokens"] == value(after, "dsaserve_prompt_tokens_total") - \
        value(before, "dsaserve_prompt_tokens_total")
    assert 20 * 12 <= r["total_input_tokens"] <= 60 * 12  # random lengths within ±50 %
    for metric in ("ttft", "tpot", "itl", "e2el"):
        s = r[metric]
        assert 0 < s["p50_ms"] <= s["p90_ms"] <= s["p99_ms"], (metric, s)
    assert r["ttft"]["p50_ms"] < r["e2el"]["p50_ms"]
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0


def test_bench_serve_chat_endpoint_and_first_request_mode(server, tmp_path):
    out = tmp_path / "first.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--endpoint", "chat", "--first-request",
               "--num-prompts", "4", "--input-len", "16", "--output-len", "6", "--json", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["first"]["ok"] and r["first"]["output_tokens"] == 6
    assert r["steady"]["completed"] == 4 and r["steady"]["total_output_tokens"] == 24
    assert r["ttft_first_over_steady_p50"] > 0


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
