"""The start-up's cuBLASLt timing (on by default) where no cuBLASLt can be called: the engine starts on torch's own
choices, and the tuned call sites decline (CPU; the GPU side is tests/kernels/test_gpu_cublaslt.py)."""

from __future__ import annotations

import contextlib

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
    def no_library(index):
        raise error

    monkeypatch.setattr(cublaslt, "handle", no_library)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    timed = set(cublaslt_tuning.TIMED)
    report = cublaslt_tuning.tune([], 128, torch.device("cuda", 7))
    assert report["chosen"] == 0 and str(error)[:40] in report["error"]
    assert timed == cublaslt_tuning.TIMED  # device 7 untimed: `linear` / `lm_head` leave it to torch
    x = torch.zeros(64, 6144)
    assert cublaslt_tuning.linear(x, x, x, x) is None
