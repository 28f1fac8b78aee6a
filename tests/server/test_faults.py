"""Engine faults: when the scheduler process dies the server turns Down and pending requests fail fast."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from openai import APIError, AsyncOpenAI, InternalServerError

from tests.server.harness import MODEL, alive

FAIL_FAST_S = 5.0  # pending requests must end well within this after the kill (they would otherwise run ~40 s)
# how long the doomed server reports Down before it exits (launcher.DOWN_EXIT_GRACE_S is 1 s): the checks below
# took longer than 1 s on a 2-core machine running two test suites, and found the server gone
DOWN_GRACE_S = 10.0


@pytest.fixture()
def doomed(server_factory):
    return server_factory(env={"DSASERVE_TEST_DOWN_EXIT_GRACE_S": str(DOWN_GRACE_S)})


def test_killing_the_scheduler_turns_the_server_down_and_fails_pending_requests_fast(doomed):
    pids = doomed.pids()

    async def scenario() -> tuple[list, float]:
        client = AsyncOpenAI(base_url=doomed.base_url, api_key="unused", timeout=60, max_retries=0)
        stream = await client.completions.create(model=MODEL, prompt="Pending", max_tokens=3000, stream=True,
                                                 extra_body={"ignore_eos": True})
        first = await anext(aiter(stream))
        assert first.choices[0].index == 0

        async def consume_stream():
            async for _ in stream:
                pass

        async def non_streaming():
            await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3000, extra_body={"ignore_eos": True})

        tasks = [asyncio.ensure_future(consume_stream()), asyncio.ensure_future(non_streaming())]
        await asyncio.sleep(0.3)  # both are running in the scheduler
        t0 = time.monotonic()
        os.kill(pids["scheduler"], signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=FAIL_FAST_S)
        await client.close()
        return results, time.monotonic() - t0

    results, elapsed = asyncio.run(scenario())
    assert elapsed < FAIL_FAST_S
    stream_err, plain_err = results
    assert isinstance(stream_err, APIError) and "down" in str(stream_err).lower()  # an SSE error event
    assert isinstance(plain_err, InternalServerError) and plain_err.status_code == 503
    assert "scheduler" in plain_err.body["message"]
    health = doomed.get("/health")
    assert health.status_code == 503 and health.json()["status"].startswith("Down")
    startup = doomed.get("/startup").json()
    assert startup["state"] == "Down" and "scheduler" in startup["reason"]
    t0 = time.monotonic()
    r = httpx.post(doomed.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    assert time.monotonic() - t0 < 1.0
    assert doomed.get("/v1/models").status_code == 503
    assert doomed.proc.poll() is None  # the HTTP process stays up to report Down for its grace, then exits 1
    assert doomed.proc.wait(timeout=DOWN_GRACE_S + 30) == 1
    assert "exiting: scheduler" in doomed.log_tail()


def test_children_die_with_the_main_process(server_factory):
    s = server_factory()
    pids = s.pids()
    os.kill(pids["main"], signal.SIGKILL)  # no cleanup code runs: the kernel / watchdog must take them down
    s.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    left = {"scheduler", "detokenizer"}
    while left and time.monotonic() < deadline:
        left = {name for name in left if alive(pids[name])}
        time.sleep(0.05)
    assert not left, f"{left} outlived the main process"


def test_a_startup_that_never_finishes_exits_with_an_error(server_factory):
    s = server_factory("--startup-timeout", "1", env={"DSASERVE_TEST_READY_DELAY_S": "60"}, wait=False)
    assert s.proc.wait(timeout=60) == 1
    assert "startup did not finish within --startup-timeout 1 s" in s.log_tail()


def test_a_broken_checkpoint_fails_startup_with_the_reason(server_factory, tmp_path, tiny_checkpoint):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint(MODEL), broken)
    shard = next(broken.glob("model-*.safetensors"))
    shard.unlink()  # a shard is missing: the HTTP process's pre-flight says so before any child starts
    s = server_factory("--model", str(broken), wait=False)
    assert s.proc.wait(timeout=60) == 2
    assert s.log_tail().strip().splitlines() == [
        f"dsaserve serve: error: {broken}/model.safetensors.index.json: points at missing shard file(s) {shard.name}"]
