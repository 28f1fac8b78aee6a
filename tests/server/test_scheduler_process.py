"""The scheduler process's message handling on a real EngineCore (fake runner): a GENERATE with n samples is
one engine request, an ABORT with a sample index ends only that sample (and is not dropped from the
detokenizer), an ABORT without one ends the request, and a bad index does not kill the loop."""

from __future__ import annotations

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.rank_group import RankGroup
from dsaserve.server import ipc
from dsaserve.server.scheduler_process import SchedulerLoop
from tests.engine.fake_runner import FakeRunner


def _loop() -> SchedulerLoop:
    core = EngineCore(EngineArgs.from_kwargs(model="glm-5.3-tiny"), runner=FakeRunner())
    return SchedulerLoop(RankGroup(core), None, None, None)  # handle() needs no socket unless a request is rejected


def _handle(loop: SchedulerLoop, kind: str, **fields) -> tuple[list, list]:
    register, drop = [], []
    loop.handle(ipc.unpack(ipc.pack(kind, **fields)), register, drop, [])
    return register, drop


def test_a_sample_abort_ends_only_that_sample_and_a_request_abort_ends_the_rest():
    loop = _loop()
    sampling = SamplingParams(n=3, temperature=0, max_tokens=50, ignore_eos=True, stop=["@@"]).to_dict()
    register, _ = _handle(loop, ipc.GENERATE, rid="r", input_ids=list(range(40, 110)), sampling=sampling,
                          detok={"prompt_tail": [5], "stop": ["@@"]})
    assert [(g["rid"], g["n"], g["stop"]) for g in register] == [("r", 3, ["@@"])]
    while loop.core.stats()["num_running"] < 3:  # the followers fork once the prompt is in KV
        loop.core.step()
    _, drop = _handle(loop, ipc.ABORT, rid="r", index=1)
    assert drop == []  # samples 0 and 2 still stream: the detokenizer must keep the request
    deltas = loop.core.step()
    assert [(d.index, d.finish_reason) for d in deltas if d.finished] == [(1, "abort")]
    assert sorted(d.index for d in deltas if not d.finished) == [0, 2]
    _, drop = _handle(loop, ipc.ABORT, rid="r", index=7)  # logged, ignored
    assert drop == [] and loop.core.stats()["num_running"] == 2
    _, drop = _handle(loop, ipc.ABORT, rid="r")
    assert drop == ["r"]
    assert sorted(d.index for d in loop.core.step() if d.finish_reason == "abort") == [0, 2]
    loop.core.check_no_leak()
