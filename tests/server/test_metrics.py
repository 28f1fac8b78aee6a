"""/metrics: valid Prometheus text (parsed by prometheus_client's parser) whose series move with traffic."""

from __future__ import annotations

import time

import httpx

from dsaserve.server.tokenizer_manager import HEALTH_CACHE_S
from tests.server.harness import MODEL, scrape, value, wait_idle

# family names as the parser reports them (counters without their _total suffix)
REQUIRED = {
    "histogram": ("dsaserve_time_to_first_token_seconds", "dsaserve_time_per_output_token_seconds",
                  "dsaserve_inter_token_latency_seconds", "dsaserve_e2e_request_latency_seconds"),
    "gauge": ("dsaserve_up", "dsaserve_num_requests_running", "dsaserve_num_requests_waiting",
              "dsaserve_kv_pages_used", "dsaserve_kv_pages_cached", "dsaserve_kv_pages_free",
              "dsaserve_kv_pages_total", "dsaserve_kv_cache_usage_ratio", "dsaserve_startup_phase_seconds"),
    "counter": ("dsaserve_prefix_cache_hit_tokens", "dsaserve_preemptions", "dsaserve_prompt_tokens",
                "dsaserve_generation_tokens", "dsaserve_graph_replays", "dsaserve_piecewise_replays",
                "dsaserve_eager_fallbacks",
                "dsaserve_requests_finished", "dsaserve_requests_received", "dsaserve_requests_aborted",
                "dsaserve_evicted_pages", "dsaserve_engine_steps"),
}


def test_metrics_parse_and_have_every_series(server):
    types, samples = scrape(server)
    for kind, names in REQUIRED.items():
        for name in names:
            assert types.get(name) == kind, (name, types.get(name))
    info = server.get("/startup").json()["scheduler_info"]
    assert value(samples, "dsaserve_kv_pages_total") == info["num_pages"]
    assert value(samples, "dsaserve_up") == 1.0
    assert value(samples, "dsaserve_graph_replays_total") == 0.0  # CPU: no CUDA graphs
    assert value(samples, "dsaserve_startup_phase_seconds", phase="up") > 0


def test_counters_move_with_traffic(server, tokenizer):
    wait_idle(server)
    _, before = scrape(server)
    prompt = list(range(7, 7 + 130))  # 130 tokens: two full 64-token pages the second request finds cached
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    wait_idle(server)
    _, after = scrape(server)

    def delta(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("dsaserve_generation_tokens_total") == 10
    assert delta("dsaserve_prompt_tokens_total") == 260
    assert delta("dsaserve_request_prompt_tokens_total") == 260
    assert delta("dsaserve_prefix_cache_hit_tokens_total") == 128
    assert delta("dsaserve_requests_received_total") == 2
    assert delta("dsaserve_requests_finished_total", finish_reason="length") == 2
    for hist in ("dsaserve_time_to_first_token_seconds", "dsaserve_e2e_request_latency_seconds",
                 "dsaserve_time_per_output_token_seconds"):
        assert delta(hist + "_count") == 2 and delta(hist + "_sum") > 0
    assert delta("dsaserve_inter_token_latency_seconds_count") == 8  # 4 gaps between 5 tokens, twice
    assert delta("dsaserve_engine_steps_total") >= 10
    assert value(after, "dsaserve_kv_pages_used") == 0 and value(after, "dsaserve_num_requests_running") == 0
    assert value(after, "dsaserve_kv_pages_cached") >= 2  # the prompt's full pages stay in the prefix cache
    # first-vs-steady TTFT for the 130-token shape (bucket le_256): both requests observed, ratio = first/median
    first = value(after, "dsaserve_ttft_first_request_seconds", prompt_bucket="le_256")
    steady = value(after, "dsaserve_ttft_steady_median_seconds", prompt_bucket="le_256")
    assert first > 0 and steady > 0
    assert abs(value(after, "dsaserve_ttft_first_over_steady", prompt_bucket="le_256") - first / steady) < 1e-9


def test_http_errors_are_counted_by_status(server):
    _, before = scrape(server)
    httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
    httpx.post(server.url + "/v1/completions", content=b"{", timeout=10)
    _, after = scrape(server)
    assert value(after, "dsaserve_http_errors_total", status="404") - value(before, "dsaserve_http_errors_total",
                                                                             status="404") == 1
    assert value(after, "dsaserve_http_errors_total", status="400") - value(before, "dsaserve_http_errors_total",
                                                                             status="400") == 1


def _help(server) -> dict[str, str]:
    text = server.get("/metrics").text
    return {line.split()[2]: line.split(" ", 3)[3] for line in text.splitlines() if line.startswith("# HELP ")}


def test_kv_pages_used_cached_and_free_add_up_while_requests_share_cached_pages(server):
    """Issue 20: cached + used exceeded the total (a page both cached and used counted twice)."""
    prompt = list(range(300, 300 + 140))  # two full pages, cached by the first request, shared by the second
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**body, "max_tokens": 3000, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()  # held: a dropped iterator closes the stream, and the request is aborted
        next(lines)
        _, s = scrape(server)
    used, cached = value(s, "dsaserve_kv_pages_used"), value(s, "dsaserve_kv_pages_cached")
    assert used >= 2 and value(s, "dsaserve_kv_pages_in_prefix_cache") >= 2
    assert used + cached + value(s, "dsaserve_kv_pages_free") == value(s, "dsaserve_kv_pages_total")


def test_abort_and_request_counters_say_what_they_count(server):
    """Issue 20: engine aborts 3 against HTTP aborts 0 (stop strings), engine requests counting /health
    probes silently, eager fallbacks 0 on CPU under a help saying "all reasons"."""
    wait_idle(server)
    _, before = scrape(server)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    r = httpx.post(server.url + "/v1/completions", json={**body, "stop": [text[3:6]]}, timeout=60)
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    time.sleep(HEALTH_CACHE_S + 0.1)
    assert server.get("/health").status_code == 200  # a fresh probe
    wait_idle(server)
    _, after = scrape(server)

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("dsaserve_engine_stop_string_samples_total") == 1
    assert delta("dsaserve_engine_aborted_requests_total") == delta("dsaserve_requests_aborted_total") == 0
    assert delta("dsaserve_health_probes_total") >= 1
    assert delta("dsaserve_engine_requests_total") == (delta("dsaserve_requests_received_total")
                                                       + delta("dsaserve_health_probes_total"))
    helps = _help(server)
    assert "/health" in helps["dsaserve_engine_requests_total"]
    assert "HTTP" in helps["dsaserve_requests_aborted_total"] and "stop string" not in helps[
        "dsaserve_engine_aborted_requests_total"]
    assert "0 without graphs" in helps["dsaserve_eager_fallbacks_total"]
