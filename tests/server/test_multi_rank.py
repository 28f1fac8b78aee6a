"""`dsaserve serve` over several ranks on the CPU (gloo): TP2, EP2 and DP-attention + EP2 answer through the real
openai client with the greedy tokens of one rank (EP2 and DP-attention also with overlap scheduling, TP2 and
DP-attention also with MTP drafts: TP ranks verify and draft alike, DP ranks each their own requests, in lockstep
MTP forwards), and so do
structured-output requests (json_schema, regex, choice: every rank compiles the grammar before the request is
admitted, engine/grammar_gate.py), whose outputs obey their grammars; a schema that cannot compile is a 400 and
the server goes on serving; two
"nodes" (two launchers on loopback) serve as one; a killed rank brings the server down with its name; a layout
that cannot be exact is refused before any spawn.

fp32 KV and float32 weights: TP / EP only reorder sums, so greedy tokens of the tiny model agree exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import pytest
from openai import OpenAI

from tests.server.harness import MODEL, START_TIMEOUT_S, ServerProcess, alive, free_port, scrape, value

EXACT = ("--kv-layout", "fp32", "--device", "cpu", "--dtype", "float32")
PROMPTS = [[5, 6, 7, 8, 9] * 8, [11, 12, 13] * 12, list(range(40, 75))]
EXIT_S = 5.0  # a killed rank must bring the server down within this


def greedy(server: ServerProcess, prompts: list[list[int]] = PROMPTS) -> list[tuple[str, list[str]]]:
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    out = []
    for p in prompts:
        c = client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0, logprobs=1,
                                      extra_body={"ignore_eos": True}).choices[0]
        out.append((c.text, list(c.logprobs.tokens)))
    return out


SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}, "ok": {"type": "boolean"}},
          "required": ["city", "ok"], "additionalProperties": False}
RX, CHOICES = "[0-9]{3}-[a-z]{2}", ["yes", "no", "maybe"]
STRUCTURED = [{"json": SCHEMA}, {"regex": RX}, {"choice": CHOICES}]


def structured(server: ServerProcess) -> list[str]:
    """Greedy structured-output completions, each checked against its grammar; then a schema xgrammar cannot
    compile is a 400 (every rank agreed it failed) and the server still answers."""
    client = OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
    out = []
    for so in STRUCTURED:
        c = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=40, temperature=0,
                                      extra_body={"structured_outputs": so}).choices[0]
        assert c.finish_reason == "stop", (so, c.text)
        out.append(c.text)
    jsonschema.validate(json.loads(out[0]), SCHEMA)
    assert re.fullmatch(RX, out[1]) and out[2] in CHOICES, out
    r = httpx.post(server.base_url + "/completions", timeout=60, json={
        "model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"json": {"type": "nonsense"}}})
    assert r.status_code == 400 and "nonsense" in r.json()["error"]["message"], r.text
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> tuple[list[tuple[str, list[str]]], list[str]]:
    s = ServerProcess(tmp_path_factory.mktemp("one"), *EXACT)
    try:
        s.wait_up()
        return greedy(s), structured(s)
    finally:
        s.stop()


OVERLAP = "--no-disable-overlap-schedule"  # overlap scheduling, off by default on the CPU, forced on


@pytest.mark.parametrize("layout", [("--tp", "2"), ("--ep", "2", OVERLAP), ("--enable-dp-attention", "--ep", "2"),
                                    ("--enable-dp-attention", "--ep", "2", OVERLAP),
                                    ("--tp", "2", "--speculative-algorithm", "mtp"),
                                    ("--enable-dp-attention", "--ep", "2", "--speculative-algorithm", "mtp",
                                     "--speculative-num-steps", "2")],
                         ids=["tp2", "ep2_overlap", "dp2_ep2", "dp2_ep2_overlap", "tp2_mtp", "dp2_ep2_mtp"])
def test_a_multi_rank_server_answers_with_the_greedy_tokens_of_one_rank(tmp_path, one_rank, layout):
    s = ServerProcess(tmp_path, *EXACT, *layout)
    try:
        s.wait_up()
        assert (greedy(s), structured(s)) == one_rank
        startup = s.get("/startup").json()
        ranks = startup["scheduler_info"]["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["startup_time"]["load_weights"] > 0 and r["kv_pool"]["num_pages"] > 0 for r in ranks)
        assert startup["scheduler_info"]["slowest_rank"] in (0, 1)
        assert startup["scheduler_info"]["overlap_schedule"] is (OVERLAP in layout)
        assert {"scheduler", "scheduler rank 1"} <= set(startup["processes"])
        if "--speculative-algorithm" in layout:  # the drafts were verified, on both ranks alike
            assert value(scrape(s)[1], "dsaserve_spec_decode_num_draft_tokens_total") > 0
            # at once: DP ranks busy together, one with more requests (drafting or not) than the other
            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                assert list(pool.map(lambda p: greedy(s, [p])[0], PROMPTS)) == one_rank[0]
            if "--enable-dp-attention" in layout:  # each rank drafted for requests of its own
                ranks = s.get("/admin/stats").json()["ranks"]
                assert len(ranks) == 2 and all(r["spec_draft_tokens"] > 0 for r in ranks), ranks
    finally:
        assert s.stop() == 0


def test_two_nodes_on_loopback_serve_as_one(tmp_path, one_rank):
    addr = f"127.0.0.1:{free_port()}"
    multi = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", addr)
    node1 = subprocess.Popen([sys.executable, "-m", "dsaserve", "serve", "--model", MODEL, *EXACT, *multi,
                              "--node-rank", "1", "--log-level", "warning"],
                             stdout=open(tmp_path / "node1.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    node0 = ServerProcess(tmp_path, *EXACT, *multi, "--node-rank", "0")
    try:
        node0.wait_up()
        assert greedy(node0) == one_rank[0]
        assert node1.poll() is None
    finally:
        assert node0.stop() == 0
        try:  # node 0 gone, node 1's rank loses its peer and node 1 exits on its own, naming the rank
            assert node1.wait(timeout=60) == 1
        finally:
            node1.kill()
    assert "scheduler rank 1 process" in (tmp_path / "node1.log").read_text()


def test_killing_a_rank_brings_the_server_down_naming_it(tmp_path):
    s = ServerProcess(tmp_path, *EXACT, "--tp", "2")
    s.wait_up()
    pids = s.pids()
    t0 = time.monotonic()
    os.kill(pids["scheduler rank 1"], signal.SIGKILL)
    rc = s.proc.wait(timeout=30)
    elapsed = time.monotonic() - t0
    assert rc == 1 and elapsed < EXIT_S, (rc, elapsed)
    assert "scheduler rank 1 process" in s.log_tail() and "exited with code -9" in s.log_tail()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
        time.sleep(0.05)
    assert not [n for n, p in pids.items() if alive(p)], "orphan processes"
    s.stop()


@pytest.mark.parametrize("flags, message", [
    (("--tp", "3"), "num_attention_heads"),
    (("--ep", "3"), "n_routed_experts"),
    (("--tp", "4", "--ep", "3"), "--expert-parallel-size 3: does not divide"),
    (("--enable-dp-attention",), "--enable-dp-attention: needs several ranks"),
    (("--enable-dp-attention", "--tp", "2"), "--enable-dp-attention: needs --expert-parallel-size"),
    (("--nnodes", "2", "--tp", "2"), "--dist-init-addr"),
])
def test_a_layout_that_cannot_be_exact_is_refused_before_any_spawn(flags, message):
    r = subprocess.run([sys.executable, "-m", "dsaserve", "serve", "--model", MODEL, "--device", "cpu", *flags],
                       capture_output=True, text=True, timeout=START_TIMEOUT_S)
    assert r.returncode == 2 and message in r.stderr, r.stderr
