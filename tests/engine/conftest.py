"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from dsaserve.common import envs
from dsaserve.engine import kernel_precompile as kp


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Fresh dsaserve and Triton caches under tmp_path, no spec list shipped (unless a test writes one), no
    pending precompile; Triton's global post-compile hook restored after (SpecRecorder chains into it)."""
    monkeypatch.setenv("DSASERVE_CACHE_DIR", str(tmp_path / "dsaserve"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("DSASERVE_KERNEL_SPECS", raising=False)
    monkeypatch.delenv("DSASERVE_PRECOMPILE", raising=False)
    monkeypatch.setattr(kp, "PACKAGED_SPECS", tmp_path / "packaged")
    monkeypatch.setattr(kp, "_pending", None)
    monkeypatch.setattr(kp, "_skipped", None)
    envs.reload()
    knobs = getattr(pytest.importorskip("triton"), "knobs", None)
    previous = knobs.runtime.jit_post_compile_hook if knobs else None
    yield tmp_path
    envs.reload()
    if knobs:
        knobs.runtime.jit_post_compile_hook = previous
