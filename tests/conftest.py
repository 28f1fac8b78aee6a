"""Shared fixtures: built-in tiny checkpoints are made once per test session in a private cache dir."""

from __future__ import annotations

import os
import tempfile

import pytest

# one cache for the whole session (and its subprocesses), unless the caller chose one
os.environ.setdefault("DSASERVE_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dsaserve-test-cache"))


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
