"""The start-up's cuBLASLt timing (on by default) where no cuBLASLt can be called: the engine starts on torch's own
choices, and the tuned call sites decline (CPU; the GPU side is tests/kernels/test_gpu_cublaslt.py)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch

from dsaserve.common import envs
from dsaserve.kernels import cublaslt, cublaslt_tuning


def test_on_unless_zero(monkeypatch):
    try:
        monkeypatch.delenv("DSASERVE_GEMM_TUNING", raising=False)
        envs.reload()
        assert envs.DSASERVE_GEMM_TUNING is True
        monkeypatch.setenv("DSASERVE_GEMM_TUNING", "0")
        envs.reload()
        assert envs.DSASERVE_GEMM_TUNING is False
    finally:
        monkeypatch.undo()
        envs.reload()


@pytest.mark.parametrize("error", [cublaslt.CublasLtError("cublaslt: torch has no libcublasLt loaded"),
                                   OSError("libcublasLt.so: cannot open shared object file")])
def test_tune_without_cublaslt_reports_and_keeps_torch(monkeypatch, error):
    """Also: a new timing forgets the device's earlier choices (another runner's), and only that device's."""
    def no_library(index):
        raise error

    monkeypatch.setattr(cublaslt, "handle", no_library)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    for table in ("_CHOICES", "_GEMMS"):
        monkeypatch.setattr(cublaslt_tuning, table, {(7, 64, 4096, 6144): "old", (3, 64, 4096, 6144): "kept"})
    monkeypatch.setattr(cublaslt_tuning, "TIMED", {3, 7})
    report = cublaslt_tuning.tune([], 128, torch.device("cuda", 7))
    assert report["chosen"] == 0 and str(error)[:40] in report["error"]
    assert {3} == cublaslt_tuning.TIMED  # device 7 untimed: `linear` / `lm_head` leave it to torch
    assert cublaslt_tuning._CHOICES == cublaslt_tuning._GEMMS == {(3, 64, 4096, 6144): "kept"}
    a = SimpleNamespace(device=torch.device("cuda", 7))
    assert cublaslt_tuning.linear(a, a, a, a) is None
