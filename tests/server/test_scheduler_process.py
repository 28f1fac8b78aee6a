"""The scheduler process's message handling on a real EngineCore (fake runner): a GENERATE with n samples is
one engine request, an ABORT with a sample index ends only that sample (and is not dropped from the
detokenizer), an ABORT without one ends the request, and a bad index does not kill the loop. Start-up report:
the slowest rank is the one whose own phases took longest (not counting its waits for the others), and the
engine's phases are consecutive (engine_core follows the runner's phases, it does not contain them)."""

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


def test_the_slowest_rank_is_the_one_that_worked_longest_not_the_one_that_waited():
    from dsaserve.server.scheduler_process import slowest_rank

    # rank 1 loads 10 s longer; rank 0 waits for it at the first collective (and a little at the rendezvous):
    # by wall time both took ~16 s, so summing every phase named rank 0
    ranks = [{"rank": 0, "startup_time": {"engine_imports": 1.0, "init_distributed": 0.4, "load_weights": 5.0,
                                          "warmup_collectives": 10.0}},
             {"rank": 1, "startup_time": {"engine_imports": 1.0, "init_distributed": 0.1, "load_weights": 15.0,
                                          "warmup_collectives": 0.01}}]
    assert slowest_rank(ranks) == 1
    assert [r["own_startup_s"] for r in ranks] == [6.0, 16.0]


def test_the_engine_core_phase_follows_the_runners_phases_instead_of_containing_them():
    import time

    t0 = time.perf_counter()
    core = EngineCore(EngineArgs.from_kwargs(model="glm-5.3-tiny", device="cpu", num_pages=4))
    wall = time.perf_counter() - t0
    phases = core.scheduler_info["startup_time"]
    assert {"load_weights", "engine_core"} <= set(phases)
    assert sum(phases.values()) <= wall  # consecutive phases: their sum is at most the time it all took
