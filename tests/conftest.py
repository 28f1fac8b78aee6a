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
