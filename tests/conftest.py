"""Shared fixtures and the test run's environment, so that `python -m pytest tests` alone is what CI runs.

Set here, before anything imports torch, for this process and every process the tests spawn (servers,
CLI commands), unless the caller already chose:
- `OMP_WAIT_POLICY=PASSIVE`: idle OpenMP threads sleep instead of spinning, which on 2 cores would starve
  the server tests' other processes;
- `DSASERVE_CACHE_DIR`: a private cache for this run (the built-in tiny checkpoints are written there once,
  seed 0);
- `TMPDIR`: a private temp dir, so the servers' IPC directories (even of a server killed with SIGKILL) land
  inside this run's directory.
The run's directory (`$TMPDIR/dsaserve-test-*`, the cache and temp dir above when they were ours) is removed
when the session ends. A caller's own `DSASERVE_CACHE_DIR` is kept (reused across runs, never deleted).
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

RUN_DIR = tempfile.mkdtemp(prefix="dsaserve-test-")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("DSASERVE_CACHE_DIR", os.path.join(RUN_DIR, "cache"))
os.makedirs(os.path.join(RUN_DIR, "tmp"))
os.environ["TMPDIR"] = os.path.join(RUN_DIR, "tmp")
tempfile.tempdir = None  # this process's tempfile follows TMPDIR too


@pytest.fixture(autouse=True, scope="session")
def _strict_counter_names():
    """Every counter a test's engine adds (CPU paths here, GPU paths on the device) must be one a run file can
    carry (common/counters.py's list): an unlisted one raises at its first add."""
    from dsaserve.common.counters import COUNTERS

    COUNTERS.strict_names = True
    yield
    COUNTERS.strict_names = False


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(RUN_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoint():
    """name -> checkpoint dir for the built-in tiny configs (written on first use, seed 0)."""
    from dsaserve.weights.checkpoint_cache import resolve_checkpoint

    return lambda name: resolve_checkpoint(name)


@pytest.fixture
def set_switch(monkeypatch):
    """set_switch(name, value) sets a DSASERVE_* switch for one test (None unsets it). The package reads its
    switches once (dsaserve/common/envs.py), so they are read again here, and after the test."""
    from dsaserve.common import envs

    def set_(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        envs.reload()

    yield set_
    monkeypatch.undo()
    envs.reload()
