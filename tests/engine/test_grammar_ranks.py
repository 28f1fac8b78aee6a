"""Structured output over two gloo ranks on the CPU (engine/grammar_gate.py through RankGroup), TP and
DP-attention: every rank compiles a request's grammar when it arrives and the leader admits it only once both
have it, so the outputs obey their grammars and equal one rank's; under TP the follower's own scheduler
produced the very same tokens (identical batches). A schema xgrammar cannot compile is rejected, and a compile
that is slow on the follower only is rejected after the timeout — on every rank alike, with no rank dying —
and later requests for it fail at once.

The cores run the fake runner (tests/engine/fake_runner.py: logits a function of the tokens read back through
the page table) over the tiny model's real tokenizer, so this takes seconds; the real model over `serve`:
tests/server/test_multi_rank.py."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import pytest
import torch.distributed as dist

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.config import load_config
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.grammar import make_spec
from dsaserve.engine.rank_group import RankGroup, run_follower
from dsaserve.engine.request import EngineRequest
from dsaserve.weights.tokenizer_builder import build_tokenizer
from tests.distributed.harness import spawn
from tests.engine.fake_runner import FakeRunner

VOCAB = 520  # past the tokenizer's 512: ids the grammar never allows
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "ok", "n"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]
RX = "[a-c]{3,9}"
GOOD = {  # rid -> (prompt, sampling)
    "json": ([40, 41, 42], dict(n=2, temperature=1.0, seed=3, max_tokens=80,
                                structured_outputs=make_spec("json_schema", SCHEMA).to_dict())),
    "rx": ([43, 44], dict(temperature=0.0, max_tokens=20, structured_outputs=make_spec("regex", RX).to_dict())),
    "choice": ([45], dict(temperature=0.8, seed=5, max_tokens=10,
                          structured_outputs=make_spec("choice", CHOICES).to_dict())),
    "free": ([46, 47], dict(temperature=0.0, max_tokens=12, ignore_eos=True)),
}
LATE = ("late", [48, 49], dict(temperature=1.0, seed=9, max_tokens=80,
                               structured_outputs=make_spec("json_schema", SCHEMA).to_dict()))  # a cache hit
BAD = make_spec("json_schema", {"type": "nonsense"}).to_dict()  # passes the static limits, xgrammar refuses it
SLOW = make_spec("regex", "slow[0-9]{2}").to_dict()  # the follower's compile of it sleeps past the timeout
SLOW_S, SLOW_TIMEOUT_S = 1.5, 0.4
DEADLINE_S = 60.0


def _core(tok) -> EngineCore:
    runner = FakeRunner(vocab=VOCAB)
    runner.tokenizer = tok
    runner.forward_idle = lambda **kw: None  # DP-attention: a rank with nothing scheduled steps idle
    return EngineCore(EngineArgs.from_kwargs(model="glm-5.3-tiny", grammar_compile_timeout=30.0), runner=runner)


def _collect(deltas, out: dict) -> None:
    for d in deltas:
        o = out.setdefault(f"{d.request_id}#{d.index}", {"tokens": [], "reason": None})
        o["tokens"] += list(d.new_token_ids)
        o["reason"] = d.finish_reason if d.finished else o["reason"]


def _step_until(group: RankGroup, out: dict, done) -> list[tuple[str, str]]:
    """Leader: iterations until done(); the rejects seen meanwhile. A hang fails instead of blocking CI."""
    rejects, t0 = [], time.monotonic()
    while not done():
        assert time.monotonic() - t0 < DEADLINE_S, f"stuck: {group.core.stats()}"
        _collect(group.step()[0], out)
        rejects += group.take_rejects()
    return rejects


def _leader(group: RankGroup) -> dict:
    out: dict = {}
    for rid, (prompt, sp) in GOOD.items():
        group.add_request(rid, prompt, SamplingParams(**sp), 0.0)
    group.add_request("bad", [50], SamplingParams(max_tokens=4, structured_outputs=BAD), 0.0)
    rejects = _step_until(group, out, lambda: not group.gate.busy and len(out) >= 2)  # some tokens out, then:
    group.add_request(LATE[0], LATE[1], SamplingParams(**LATE[2]), 0.0)  # admitted while others decode
    group.gate.timeout = SLOW_TIMEOUT_S
    group.add_request("slow", [51], SamplingParams(max_tokens=4, structured_outputs=SLOW), 0.0)
    finished = len(GOOD) + 2  # json has two samples
    rejects += _step_until(group, out, lambda: not group.gate.busy and sum(
        o["reason"] is not None for o in out.values()) == finished and not group.core.has_unfinished())
    group.check_grammar("again", SLOW)  # cached as failed on the leader: answered at once
    group.step()
    checks = group.take_checks()
    group.stop()
    group.step()
    return {"out": out, "rejects": rejects, "checks": checks}


def _rank(rank: int, init_method: str, dp: bool, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    core = _core(build_tokenizer(load_config("glm-5.3-tiny")))
    group = RankGroup(core, dp_attention=dp)
    if rank == 0:
        result = _leader(group)
    else:
        compile_ = core.grammars._compile
        core.grammars._compile = lambda spec: (time.sleep(SLOW_S) if spec.value == SLOW["value"] else None,
                                               compile_(spec))[1]
        mine: dict = {}
        step = core.step
        core.step = lambda **kw: (d := step(**kw), _collect(d, mine))[0]  # this rank's own deltas
        run_follower(group)
        result = {"out": mine, "gate_left": len(group.gate.entries)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_config("glm-5.3-tiny"))


@pytest.fixture(scope="module")
def one_rank(tok) -> dict:
    """The good requests on one core, no rank group: each structured request compiled in add_request."""
    core = _core(tok)
    out: dict = {}
    for rid, (prompt, sp) in [*GOOD.items(), (LATE[0], (LATE[1], LATE[2]))]:
        core.add_request(EngineRequest(rid, prompt, SamplingParams(**sp)))
    while core.has_unfinished():
        _collect(core.step(), out)
    return out


def _obeys(tok, key: str, o: dict) -> None:
    text = tok.decode(o["tokens"][:-1])  # the grammar completed: the last token is EOS
    assert o["reason"] == "stop", (key, text)
    rid = key.split("#")[0]
    if rid in ("json", "late"):
        jsonschema.validate(json.loads(text), SCHEMA)
    elif rid == "rx":
        assert re.fullmatch(RX, text), text
    else:
        assert text in CHOICES, text


@pytest.mark.parametrize("dp", [False, True], ids=["tp2", "dp2"])
def test_two_ranks_admit_structured_requests_together_and_reject_alike(tmp_path, tok, one_rank, dp):
    spawn(_rank, 2, dp, str(tmp_path))  # raises if either rank died
    lead = json.loads((tmp_path / "rank0.json").read_text())
    follower = json.loads((tmp_path / "rank1.json").read_text())
    assert lead["out"] == one_rank
    for key, o in lead["out"].items():
        if not key.startswith("free"):
            _obeys(tok, key, o)
    reasons = dict(lead["rejects"])
    assert set(reasons) == {"bad", "slow"}
    assert "cannot be compiled" in reasons["bad"] and "nonsense" in reasons["bad"]
    assert f"compiling took longer than {SLOW_TIMEOUT_S:g} s" in reasons["slow"]
    (qid, error), = lead["checks"]
    assert qid == "again" and "compiling took longer" in error
    assert follower["gate_left"] == 0  # every entry the leader decided was dropped on the follower too
    if dp:  # each rank ran its own requests: together, all of them
        assert set(follower["out"]) < set(lead["out"]) and follower["out"]
        assert all(lead["out"][k] == v for k, v in follower["out"].items())
    else:  # the follower's scheduler formed the same batches and sampled the same tokens
        assert follower["out"] == lead["out"]
