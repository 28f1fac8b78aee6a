"""The scheduler leader's grammar gate: a request whose grammar is compiling waits outside the core while the
loop goes on, a check answers with the compile's error, a compile past the timeout fails (and is cached as
failed), and an abort of a waiting request drops it."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.grammar import GrammarError, make_spec
from dsaserve.engine.rank_group import RankGroup
from dsaserve.server import ipc
from dsaserve.server.grammar_gate import GrammarGate
from dsaserve.server.scheduler_process import SchedulerLoop
from tests.engine.fake_runner import FakeRunner

SPEC = make_spec("regex", "[a-z]+").to_dict()


class StubGrammars:
    def __init__(self):
        self.futures: dict = {}
        self.failed: list = []

    def submit(self, spec):
        return self.futures.setdefault(spec, Future())

    def fail(self, spec, reason):
        self.failed.append((spec, reason))

    def compile(self, spec, timeout=None):
        return self.futures[spec].result(0)

    def state(self, compiled, spec=None):
        return None


def _gate(timeout: float = 10.0) -> tuple[GrammarGate, StubGrammars]:
    grammars = StubGrammars()
    core = SimpleNamespace(args=SimpleNamespace(grammar_compile_timeout=timeout), grammars=grammars)
    return GrammarGate(core), grammars


def _generate(rid: str) -> dict:
    sampling = SamplingParams(max_tokens=4, structured_outputs=SPEC).to_dict()
    return ipc.unpack(ipc.pack(ipc.GENERATE, rid=rid, input_ids=[5, 6, 7], sampling=sampling))


def test_a_request_waits_until_its_grammar_is_compiled():
    gate, grammars = _gate()
    assert gate.park(_generate("r1")) and gate.busy
    assert gate.ready_requests() == []
    next(iter(grammars.futures.values())).set_result("compiled")
    assert [m["rid"] for m in gate.ready_requests()] == ["r1"] and not gate.busy
    assert not gate.park(_generate("r2"))  # compiled already: straight to the core


def test_checks_answer_with_the_compile_error_and_timeouts_fail_and_are_cached():
    gate, grammars = _gate(timeout=0.05)
    gate.check(1, SPEC)
    gate.check(2, {"kind": "regex", "value": "(bad"})  # refused before any compile
    fut = next(iter(grammars.futures.values()))
    assert gate.check_results() == [(2, "regex: invalid regular expression (missing ), unterminated subpattern "
                                        "at position 0)")]
    time.sleep(0.06)
    (qid, error), = gate.check_results()
    assert qid == 1 and "longer than 0.05 s" in error and grammars.failed
    assert not fut.done()


def test_the_loop_parks_a_structured_request_and_an_abort_drops_it():
    core = EngineCore(EngineArgs.from_kwargs(model="glm-5.3-tiny"), runner=FakeRunner())
    loop = SchedulerLoop(RankGroup(core), None, None, None)
    loop.gate, grammars = _gate()
    core._grammars = grammars  # the core compiles through the same (stub) cache
    register: list = []
    loop.handle(_generate("r"), register, [], [])
    assert register == [] and not core.has_unfinished() and loop.busy()
    drop: list = []
    loop.handle(ipc.unpack(ipc.pack(ipc.ABORT, rid="r")), register, drop, [])
    assert not loop.gate.busy and drop == []
    loop.handle(_generate("r3"), register, [], [])
    next(iter(grammars.futures.values())).set_exception(GrammarError("regex: cannot be compiled: boom"))
    sent = []
    loop.to_main = SimpleNamespace(send=sent.append)
    for msg in loop.gate.ready_requests():
        loop.generate(msg, register)
    assert register == [] and "boom" in ipc.unpack(sent[0])["message"]  # REJECT -> 400 in the main process
