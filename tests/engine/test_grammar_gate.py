"""The grammar gate on one rank (engine/grammar_gate.py through RankGroup): a structured request waits outside
the core while its grammar compiles and the loop goes on, a check answers with the compile's error, a compile
past the timeout fails everywhere (and is cached as failed), an abort of a waiting request drops it, the spec
is parsed once per request, and the leader decides on the other ranks' reports (the multi-rank runs:
tests/engine/test_grammar_ranks.py)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine import grammar as grammar_mod
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.grammar import GrammarError, GrammarSpec, make_spec
from dsaserve.engine.grammar_gate import OK, PENDING, GrammarGate
from dsaserve.engine.rank_group import RankGroup
from dsaserve.server import ipc
from dsaserve.server.scheduler_process import SchedulerLoop
from tests.engine.fake_runner import FakeRunner

SPEC = make_spec("regex", "[a-z]+").to_dict()


class StubGrammars:
    """The compile cache, with compiles the test finishes by hand."""

    def __init__(self):
        self.futures: dict = {}
        self.failed: list = []

    def submit(self, spec):
        return self.futures.setdefault(spec, Future())

    def fail(self, spec, reason):
        self.failed.append((spec, reason))

    def compile(self, spec, timeout=None):
        raise AssertionError("the gate hands the core its compiled grammar: nothing compiles in add_request")

    def state(self, compiled, spec=None, after=None):
        return None


def _group(timeout: float = 10.0) -> tuple[RankGroup, StubGrammars]:
    core = EngineCore(EngineArgs.from_kwargs(model="glm-5.3-tiny", grammar_compile_timeout=timeout),
                      runner=FakeRunner())
    core._grammars = StubGrammars()
    return RankGroup(core), core._grammars


def _sampling(spec=SPEC) -> SamplingParams:
    return SamplingParams(max_tokens=4, structured_outputs=spec)


def test_a_request_waits_until_its_grammar_is_compiled_while_others_run():
    group, grammars = _group()
    group.add_request("free", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True), 0.0)
    group.add_request("r1", [5, 6, 7], _sampling(), 0.0)
    assert group.waiting("r1") and "r1" not in group.core.scheduler.groups
    deltas, _ = group.step()
    assert {d.request_id for d in deltas} == {"free"} and group.waiting("r1")
    next(iter(grammars.futures.values())).set_result("compiled")
    group.step()
    assert not group.waiting("r1") and "r1" in group.core.scheduler.groups and not group.gate.busy
    with pytest.raises(ValueError, match="already in flight"):
        group.add_request("r1", [5], _sampling(), 0.0)


def test_checks_answer_with_the_compile_error_and_timeouts_fail_and_are_cached():
    group, grammars = _group(timeout=0.05)
    group.check_grammar(1, SPEC)
    group.check_grammar(2, {"kind": "regex", "value": "(bad"})  # refused before any compile
    fut = next(iter(grammars.futures.values()))
    group.step()
    assert group.take_checks() == [(2, "regex: invalid regular expression (missing ), unterminated subpattern "
                                       "at position 0)")]
    time.sleep(0.06)
    group.step()
    (qid, error), = group.take_checks()
    assert qid == 1 and "longer than 0.05 s" in error and grammars.failed
    assert not fut.done()


def test_a_failed_compile_rejects_the_request_and_an_abort_drops_a_waiting_one():
    group, grammars = _group()
    with pytest.raises(ValueError, match="structured_outputs: regex: invalid regular expression"):
        group.add_request("bad", [5], _sampling({"kind": "regex", "value": "(bad"}), 0.0)
    group.add_request("r", [5, 6], _sampling(), 0.0)
    assert group.abort_request("r") and not group.waiting("r") and not group.gate.busy
    group.add_request("r3", [5, 6], _sampling(), 0.0)
    next(iter(grammars.futures.values())).set_exception(GrammarError("regex: cannot be compiled: boom"))
    group.step()
    assert group.take_rejects() == [("r3", "structured_outputs: regex: cannot be compiled: boom")]
    assert not group.core.has_unfinished()


def test_the_leader_admits_only_when_every_rank_reported_it_compiled():
    core = SimpleNamespace(args=SimpleNamespace(grammar_compile_timeout=10.0), grammars=StubGrammars())
    gate = GrammarGate(core, world=2)
    w = gate.open(SPEC, rid="r", request=([5], _sampling(), 0.0))
    w.fut.set_result("compiled")
    assert gate.settle() == []  # rank 1 has not said
    gate.record(1, [[w.gid, PENDING]])
    assert gate.settle() == []
    gate.record(1, [[w.gid, OK]])
    assert gate.settle() == [w] and w.error is None and not gate.busy
    w2 = gate.open(SPEC, qid=7)
    gate.record(1, [[w2.gid, "regex: cannot be compiled: only on rank 1"]])
    assert gate.settle() == [w2] and w2.error == "regex: cannot be compiled: only on rank 1"


def test_the_loop_parks_a_structured_request_and_reports_a_reject(monkeypatch):
    group, grammars = _group()
    loop = SchedulerLoop(group, None, None, None)
    to_main, to_detok = [], []
    loop.to_main, loop.to_detok = SimpleNamespace(send=to_main.append), SimpleNamespace(send=to_detok.append)
    register: list = []
    msg = ipc.unpack(ipc.pack(ipc.GENERATE, rid="r", input_ids=[5, 6, 7], sampling=_sampling().to_dict()))
    loop.handle(msg, register, [], [])
    assert [r["rid"] for r in register] == ["r"] and not group.core.has_unfinished() and loop.busy()
    next(iter(grammars.futures.values())).set_exception(GrammarError("regex: cannot be compiled: boom"))
    monkeypatch.setattr(ipc, "drain", lambda sock, ms: [])
    loop.run_once()
    reject = ipc.unpack(to_main[0])
    assert reject["t"] == ipc.REJECT and reject["rid"] == "r" and "boom" in reject["message"]  # -> a 400
    assert ipc.unpack(to_detok[0])["drop"] == ["r"] and not loop.busy()


def test_a_request_spec_is_parsed_once(monkeypatch):
    calls = []
    real = grammar_mod.make_spec
    monkeypatch.setattr(grammar_mod, "make_spec", lambda *a: calls.append(a) or real(*a))
    group, grammars = _group()
    group.add_request("r", [5, 6], _sampling(make_spec("json_schema", {"type": "integer"}).to_dict()), 0.0)
    next(iter(grammars.futures.values())).set_result("compiled")
    group.step()
    assert "r" in group.core.scheduler.groups and len(calls) == 1
    assert next(iter(grammars.futures)) == GrammarSpec("json_schema", '{"type":"integer"}')
