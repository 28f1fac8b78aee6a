"""Startup bookkeeping on a scripted clock: the main process's laps are consecutive and add up to total_s
from the process's creation; milestones count from the creation too; the Readiness gate ends
`wait_for_ready` at Up and `health_probe` at the first passing probe (once); children's own phases and the
caches' hit/miss reach the manifest."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsaserve.server.launcher import Readiness
from dsaserve.server.server_args import ServerArgs
from dsaserve.server.startup_clock import CRITICAL_PATH, StartupClock, child_phases, process_age_s


class Ticks:
    """A wall clock that only moves when told."""

    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def clock_at(created: float = 1000.0, first_line: float = 1000.25) -> tuple[StartupClock, Ticks]:
    ticks = Ticks(first_line)
    return StartupClock(first_line, created=created, now=ticks), ticks


def test_laps_are_consecutive_and_add_up_to_the_total():
    clock, ticks = clock_at()
    assert clock.laps == {"interpreter": 0.25} and clock.total_s() is None and not clock.done
    for name, dt in zip(CRITICAL_PATH[1:], (0.5, 2.0, 1.0, 0.01, 0.02, 4.0, 0.1), strict=True):
        ticks.t += dt
        clock.lap(name)
    assert list(clock.laps) == list(CRITICAL_PATH) and clock.done
    assert clock.total_s() == pytest.approx(ticks.t - 1000.0) == pytest.approx(sum(clock.laps.values()))
    assert clock.phases()["total_s"] == clock.total_s() and list(clock.phases())[-1] == "total_s"


def test_milestones_count_from_the_process_creation_and_a_lap_never_goes_negative():
    clock, ticks = clock_at()
    ticks.t = 1003.5
    assert clock.milestone("up") == pytest.approx(3.5)
    assert clock.lap("late", at=1001.0) == 0.75  # an explicit end time: since the interpreter lap (1000.25)
    assert clock.lap("earlier", at=1000.5) == 0.0  # before the last lap's end: zero, not negative
    assert clock.phases()["up"] == pytest.approx(3.5)


def test_the_real_clock_starts_at_the_process_creation():
    age = process_age_s()
    assert age > 0  # this test runs well after the interpreter started (Linux /proc)
    # first line = now: the interpreter lap is the process's age (10 ms ticks); ran_before 0: as a process that ran
    # no other program (pytest's own children would count here)
    clock = StartupClock(ran_before=0.0)
    assert clock.laps["interpreter"] == pytest.approx(age, abs=0.05) and clock.interpreter_clock is None


def test_a_process_that_ran_other_programs_first_counts_from_its_first_line():
    """A shell that ran `pip install` and then exec'd dsaserve: the process's creation is the shell's, so the
    interpreter lap is 0 and says why (the README's first line logged 67 s of "interpreter" so)."""
    clock = StartupClock(1000.25, now=Ticks(1000.25), ran_before=42.5)
    assert clock.laps == {"interpreter": 0.0} and "42.50 s" in clock.interpreter_clock
    assert clock.milestone("up") == 0.0


@pytest.mark.parametrize("exec_after_work", [True, False])
def test_the_real_clock_sees_a_shell_that_ran_a_program_before_its_exec(exec_after_work):
    """Real processes: `bash -c "<a CPU-bound python> && exec python ..."` is one process from the shell's fork, and
    its reaped child's CPU time shows; a python started on its own has none."""
    import subprocess
    import sys

    probe = ("from dsaserve.server.startup_clock import StartupClock, reaped_children_cpu_s; "
             "c = StartupClock(); print(reaped_children_cpu_s() > 0, c.interpreter_clock is not None)")
    work = f"{sys.executable} -c 'sum(range(3 * 10 ** 7))' && " if exec_after_work else ""
    out = subprocess.run(["bash", "-c", f"{work}exec {sys.executable} -c \"{probe}\""], capture_output=True, text=True,
                         check=True, cwd=str(Path(__file__).resolve().parents[2])).stdout.split()
    assert out == [str(exec_after_work)] * 2


def test_child_phases_split_spawn_from_imports():
    assert child_phases("detokenizer", 10.0, 10.5, 11.25) == {"detokenizer_spawn": 0.5, "detokenizer_imports": 0.75}
    assert child_phases("scheduler", None, 10.5, 10.75)["scheduler_spawn"] == 0.0  # no spawn time given


def test_readiness_ends_the_wait_at_up_and_the_startup_at_the_first_healthy_probe(tmp_path):
    clock, ticks = clock_at()
    for name in CRITICAL_PATH[1:6]:
        ticks.t += 0.1
        clock.lap(name)
    clock.cache("model_files", "hit", kind="checkpoint", path="/x")
    r = Readiness(clock)
    healthy: list[bool] = []
    r.on_healthy.append(lambda: healthy.append(True))
    r.mark_healthy()  # not Up yet: nothing ends
    ticks.t += 1.0
    r.mark_ready("detokenizer", {"startup_time": {"detokenizer_spawn": 0.1, "detokenizer_imports": 0.2}})
    ticks.t += 2.0
    r.mark_ready("scheduler", {"startup_time": {"scheduler_spawn": 0.1, "engine_imports": 1.5}})
    assert r.is_up and r.phases["wait_for_ready"] == pytest.approx(3.0) and "health_probe" not in r.phases
    ticks.t += 0.05
    r.mark_healthy()
    ticks.t += 9.0
    r.mark_healthy()  # later probes change nothing
    assert healthy == [True]
    st = r.startup_time()
    assert list(st)[: len(CRITICAL_PATH)] == list(CRITICAL_PATH)
    assert st["total_s"] == pytest.approx(0.25 + 0.5 + 3.0 + 0.05) == pytest.approx(sum(st[k] for k in CRITICAL_PATH))
    assert st["up"] == pytest.approx(3.75) and st["detokenizer_ready"] == pytest.approx(1.75)
    assert st["engine_imports"] == 1.5 and st["detokenizer_imports"] == 0.2
    args = ServerArgs(engine_args={}, model_dir=str(tmp_path), served_model_name="m")
    m = r.manifest(args)
    assert m["startup"]["total_s"] == st["total_s"] and m["startup"]["critical_path"] == list(CRITICAL_PATH)
    assert m["startup"]["caches"]["model_files"]["status"] == "hit"
    assert m["startup"]["caches"]["compile"]["status"].startswith("not used")  # no GPU engine reported one
    assert "warm_start" not in m["startup"]["caches"]  # nor a warm-start record
    warm = {"status": "hit", "dir": "/c/warm_start/k", "preload": {"status": "hit", "specs": 93},
            "memory_profile": "hit"}
    caches = r.startup({"warm_start": warm})["caches"]
    assert caches["warm_start"]["status"] == "hit" and caches["warm_start"]["preload"]["specs"] == 93
    assert caches["memory_profile"] == {"status": "hit"}
