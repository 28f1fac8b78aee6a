"""Startup accounting: every second from the process's first instruction to the first 200 of `/health`.

Owns: `StartupClock`, the main process's critical path of `dsaserve serve` as consecutive phases on one
wall clock (`time.time()`), so that they add up to `total_s` exactly:

  interpreter       process created -> first line of `dsaserve.cli` (Python start-up, read from /proc; 0 and
                    `interpreter_clock` says why where the process ran other programs first: a shell that
                    exec'd dsaserve as its last command, `bash -c "pip install ... && dsaserve serve"`)
  cli_imports       -> `serve` runs (argparse, the engine and server flags)
  resolve_model     -> --model is a directory (built-in: its cached checkpoint or config+tokenizer, made on a miss)
  spawn_processes   -> every scheduler rank and the detokenizer are started (from here on the children's
                       start-up runs beside the main process's next laps)
  launcher_imports  -> the HTTP stack is imported (FastAPI, uvicorn, tokenizers, jinja2)
  main_tokenizer    -> the main process's tokenizer is loaded
  wait_for_ready    -> every child reported ready (their own phases are listed beside, by process)
  health_probe      -> the first 1-token probe through the whole loop passed: /health answers 200

plus milestones (seconds since the process was created: `detokenizer_ready`, `scheduler_ready`, `up`), the
children's own phases (`child_phases`: spawn -> their first line, their module imports), and what each
cache on the way did (hit or miss). Nothing here imports more than the standard library: `dsaserve.cli`
imports it before anything heavy.
"""

from __future__ import annotations

import os
import time
from typing import Any

CRITICAL_PATH = ("interpreter", "cli_imports", "resolve_model", "spawn_processes", "launcher_imports",
                 "main_tokenizer", "wait_for_ready", "health_probe")


def _stat_fields() -> list[str]:
    """/proc/self/stat's fields from the 3rd on (after the command name); [] where it cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_age_s() -> float:
    """Seconds since this process was created (Linux /proc, 10 ms ticks); 0.0 where that cannot be read."""
    try:
        start_ticks = int(_stat_fields()[19])  # field 22, starttime
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (ValueError, IndexError, AttributeError):
        return 0.0


def reaped_children_cpu_s() -> float:
    """CPU seconds of the children this process waited for (fields 16-17, cutime + cstime; 10 ms ticks). Python
    starts none before the entry point's first line, so more than 0 there means the process ran other programs
    before it became this one (a shell's exec): its creation time is not Python's start. (A shell whose earlier
    commands used under a 10 ms tick of CPU, `sleep 5; exec dsaserve ...`, is not seen: its wait still counts.)"""
    try:
        fields = _stat_fields()
        return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
    except (ValueError, IndexError, AttributeError):
        return 0.0


def child_phases(who: str, spawn_time: float | None, first_line: float, run_start: float) -> dict[str, float]:
    """A child process's own start-up: `<who>_spawn` (its parent's Popen -> the child module's first line:
    the interpreter and the package's __init__) and `<who>_imports` (its module's imports)."""
    spawn = first_line if spawn_time is None else spawn_time
    return {f"{who}_spawn": round(max(0.0, first_line - spawn), 4),
            f"{who}_imports": round(max(0.0, run_start - first_line), 4)}


class StartupClock:
    """Consecutive laps from the process's creation; `first_line` is `time.time()` at the first line of the
    entry point (the interpreter lap ends there). Where the process ran other programs before Python
    (`reaped_children_cpu_s`, injectable as `ran_before`), the clock starts at the first line and
    `interpreter_clock` says why. `now` is injectable for tests."""

    def __init__(self, first_line: float | None = None, created: float | None = None,
                 now: Any = time.time, ran_before: float | None = None) -> None:
        self.now = now
        first_line = now() if first_line is None else first_line
        self.interpreter_clock: str | None = None
        ran = (reaped_children_cpu_s() if ran_before is None else ran_before) if created is None else 0.0
        if ran > 0:
            self.interpreter_clock = (f"not measured: this process ran other programs ({ran:.2f} s of their CPU) "
                                      f"before Python started (a shell exec'd it), so it counts from the entry "
                                      f"point's first line")
            created = first_line
        self.created = min(first_line, now() - process_age_s()) if created is None else created
        self.laps: dict[str, float] = {}
        self.milestones: dict[str, float] = {}
        self.caches: dict[str, dict[str, Any]] = {}
        self._last = self.created
        self.lap("interpreter", first_line)

    def lap(self, name: str, at: float | None = None) -> float:
        """The phase `name` ends now (or at `at`): it took the time since the previous lap ended."""
        at = self.now() if at is None else at
        seconds = max(0.0, at - self._last)
        self.laps[name] = round(self.laps.get(name, 0.0) + seconds, 4)
        self._last = max(self._last, at)
        return seconds

    def milestone(self, name: str) -> float:
        """Seconds since the process was created, recorded under `name`."""
        self.milestones[name] = round(self.now() - self.created, 4)
        return self.milestones[name]

    def cache(self, name: str, status: str, **details: Any) -> None:
        """What one cache did on this start: status "hit", "miss", or why it was not used."""
        self.caches[name] = {"status": status, **details}

    @property
    def done(self) -> bool:
        return "health_probe" in self.laps

    def total_s(self) -> float | None:
        """Process creation -> the end of the last lap; None until /health first answered 200."""
        return round(self._last - self.created, 4) if self.done else None

    def phases(self) -> dict[str, float]:
        """The laps in order, then the milestones, then `total_s` once known."""
        out = {**self.laps, **self.milestones}
        if self.done:
            out["total_s"] = self.total_s()
        return out
