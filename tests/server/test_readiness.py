"""Readiness gate and shutdown: 503 while Starting, 200 once Up; health probes are coalesced; /startup holds
every phase; SIGTERM drains."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from openai import OpenAI

from dsaserve.server.tokenizer_manager import HEALTH_CACHE_S
from tests.server.harness import MODEL, admin_stats, alive

READY_DELAY_S = 3.0

# phases the startup chain reports: the scheduler process and engine, then the main process
ENGINE_PHASES = ("scheduler_spawn", "resolve_checkpoint", "load_weights", "kv_pool", "engine_core")
MAIN_PHASES = ("main_tokenizer", "spawn_processes", "detokenizer_ready", "scheduler_ready", "up")


@pytest.fixture(scope="module")
def manifest_path(tmp_path_factory):
    return tmp_path_factory.mktemp("manifest") / "startup.json"


@pytest.fixture(scope="module")
def slow_start(server_factory, manifest_path):
    """A server whose scheduler waits READY_DELAY_S after its startup chain before reporting ready."""
    s = server_factory("--manifest-json", str(manifest_path), env={"DSASERVE_TEST_READY_DELAY_S": str(READY_DELAY_S)},
                       wait=False)
    s.wait_listening()
    return s


def _error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_health_is_503_while_starting_then_200_once_up(slow_start):
    r = slow_start.get("/health")
    assert r.status_code == 503 and r.json()["status"].startswith("Starting")
    assert slow_start.get("/startup").json()["state"] == "Starting"
    assert _error(slow_start.get("/v1/models"), 503)["code"] == "service_unavailable"  # never lies
    r = httpx.post(slow_start.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert _error(r, 503)["code"] == "service_unavailable"
    slow_start.wait_up()
    assert slow_start.get("/health").json() == {"status": "ok"}
    assert slow_start.get("/startup").json()["state"] == "Up"
    assert slow_start.get("/v1/models").status_code == 200


def test_concurrent_health_calls_share_one_engine_probe(server):
    """/health is open (no API key): a burst must not turn into a burst of engine requests."""
    server.wait_up()
    time.sleep(HEALTH_CACHE_S + 0.2)  # any cached result has expired: this burst needs a fresh probe
    before = admin_stats(server)["stats"]["requests"]  # the scheduler counts every request it admits

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
            return await asyncio.gather(*(c.get("/health") for _ in range(50)))

    t0 = time.monotonic()
    responses = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    probes = admin_stats(server)["stats"]["requests"] - before
    assert [r.status_code for r in responses] == [200] * 50
    assert all(r.json() == {"status": "ok"} for r in responses)
    # one probe in flight at a time, and its result reused for HEALTH_CACHE_S after it returns
    assert 1 <= probes <= 1 + int(elapsed / HEALTH_CACHE_S), (probes, elapsed)


def test_startup_manifest_holds_every_phase(slow_start, manifest_path):
    slow_start.wait_up()
    m = slow_start.get("/startup").json()
    written = json.loads(manifest_path.read_text())  # --manifest-json: the same manifest, written once Up
    assert written["state"] == "Up" and written["startup_time"] == m["startup_time"]
    phases = m["startup_time"]
    for name in ENGINE_PHASES + MAIN_PHASES:
        assert name in phases and phases[name] >= 0, (name, phases)
    assert phases["test_ready_delay"] == READY_DELAY_S
    assert phases["up"] >= READY_DELAY_S and phases["up"] >= phases["detokenizer_ready"]
    info = m["scheduler_info"]
    assert m["max_req_input_len"] == info["max_req_input_len"] == info["max_model_len"] - 1
    assert m["kv_pool"]["num_pages"] == info["num_pages"] > 0
    assert m["kv_pool"]["total_bytes"] > 0
    assert m["weights"]["tensors_loaded"] > 0 and m["weights"]["not_loaded"]  # MTP weights skipped on purpose
    assert all(alive(m["processes"][name]) for name in ("main", "scheduler", "detokenizer"))


def test_sigterm_drains_in_flight_requests_then_exits_cleanly(slow_start):
    slow_start.wait_up()
    pids = slow_start.pids()
    client = OpenAI(base_url=slow_start.base_url, api_key="unused", timeout=60, max_retries=0)
    stream = client.completions.create(model=MODEL, prompt="Drain me", max_tokens=120, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    os.kill(pids["main"], signal.SIGTERM)
    time.sleep(0.5)
    # a new connection during the drain is answered, with 503 and an error object (issue 20.4), not refused
    r = httpx.post(slow_start.url + "/v1/completions", json={"model": MODEL, "prompt": "late"}, timeout=5)
    assert _error(r, 503)["code"] == "service_unavailable" and "draining" in r.json()["error"]["message"]
    health = httpx.get(slow_start.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"].startswith("draining")
    chunks += list(stream)  # the in-flight request runs to its end
    assert chunks[-1].usage.completion_tokens == 120
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert slow_start.proc.wait(timeout=30) == 0
    assert not alive(pids["scheduler"]) and not alive(pids["detokenizer"])


def test_a_drain_that_runs_out_ends_every_request_with_an_error_object(server_factory):
    """--drain-timeout 0.9 is 0.9 s (it was cut to int 0); when it runs out, a non-streaming client gets a
    503 error object and a stream gets a final SSE error event and [DONE] (issue 20.4)."""
    s = server_factory("--drain-timeout", "0.9")
    long = {"model": MODEL, "prompt": "Drain me", "max_tokens": 3000, "ignore_eos": True}

    async def scenario() -> tuple[list[str], httpx.Response, float]:
        async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
            plain = asyncio.ensure_future(c.post("/v1/completions", json=long))
            async with c.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:
                lines = r.aiter_lines()
                events = [await anext(lines)]  # the stream is running
                os.kill(s.pids()["main"], signal.SIGTERM)
                t0 = time.monotonic()
                events += [line async for line in lines if line]
                cut_after = time.monotonic() - t0
            return [e for e in events if e], await plain, cut_after

    events, plain, cut_after = asyncio.run(scenario())
    assert cut_after >= 0.8, cut_after  # the drain waited its 0.9 s
    assert events[-1] == "data: [DONE]"
    err = json.loads(events[-2].removeprefix("data: "))["error"]
    assert err["code"] == "service_unavailable" and "--drain-timeout 0.9 s" in err["message"]
    assert _error(plain, 503)["code"] == "service_unavailable"
    assert s.proc.wait(timeout=30) == 0


def test_sigterm_to_the_whole_process_group_stops_cleanly(server_factory):
    """systemd and `timeout` signal every process of the group: the children die with the drain, which is a
    shutdown (a warning and exit 0), not a fault logged as an error."""
    s = server_factory()
    pids = s.pids()
    for who in ("main", "scheduler", "detokenizer"):  # as the group signal reaches them
        os.kill(pids[who], signal.SIGTERM)
    assert s.proc.wait(timeout=30) == 0
    log = s.log_tail(20000)
    assert "SIGTERM while draining" in log and "ERROR" not in log, log
