"""engine/early_cuda.py: which GPU a rank's early context is for (as `local_device` picks it), the switch, and
a machine without libcuda (the thread fails quietly; torch makes the context later, as before)."""

from __future__ import annotations

import os

import pytest

from dsaserve.common import envs
from dsaserve.engine import early_cuda


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_RANK", "DSASERVE_EARLY_CUDA", "CUDA_MODULE_LOADING"):
        monkeypatch.delenv(name, raising=False)
    envs.reload()
    monkeypatch.setattr(early_cuda, "_report", {"status": "not started"})
    yield
    envs.reload()


def test_the_ordinal_is_the_ranks_gpu(monkeypatch):
    assert early_cuda.device_ordinal({"device": "cpu"}) is None
    assert early_cuda.device_ordinal({"device": "cuda"}) == 0
    assert early_cuda.device_ordinal({"device": "cuda:3"}) == 3
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert early_cuda.device_ordinal({"device": "cuda"}) == 2  # local_device: cuda without an index
    assert early_cuda.device_ordinal({"device": "cuda:1"}) == 1  # an explicit index wins there too
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert early_cuda.device_ordinal({"device": "cuda"}) == 0  # one rank: torch's current device


def test_no_device_given_follows_the_gpu_check(monkeypatch):
    monkeypatch.setattr("dsaserve.engine.engine_args.no_gpu_present", lambda: True)
    assert early_cuda.device_ordinal({}) is None
    monkeypatch.setattr("dsaserve.engine.engine_args.no_gpu_present", lambda: False)
    assert early_cuda.device_ordinal({"device": None}) == 0


def test_switched_off_and_cpu_ranks_start_nothing(monkeypatch):
    assert early_cuda.start({"device": "cpu"}) is None
    assert early_cuda.report()["status"] == "not a CUDA rank"
    monkeypatch.setenv("DSASERVE_EARLY_CUDA", "0")
    envs.reload()
    assert early_cuda.start({"device": "cuda"}) is None and early_cuda.report()["status"] == "off"


def test_a_driver_failure_is_reported_not_raised(monkeypatch):
    class NoDriver:
        def __init__(self, name):
            raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(early_cuda.ctypes, "CDLL", NoDriver)
    thread = early_cuda.start({"device": "cuda"})
    assert thread is not None
    thread.join(timeout=30)
    r = early_cuda.report()
    assert r["status"] == "failed" and "libcuda.so.1" in r["error"] and r["seconds"] >= 0
    assert os.environ["CUDA_MODULE_LOADING"] == "LAZY"  # what torch's own CUDA init would have set before cuInit


def test_a_driver_error_code_is_reported(monkeypatch):
    calls = []

    class FakeLib:
        def __getattr__(self, name):
            def call(*args):
                calls.append(name)
                return 100 if name == "cuDeviceGet" else 0  # CUDA_ERROR_NO_DEVICE

            return call

    monkeypatch.setattr(early_cuda.ctypes, "CDLL", lambda name: FakeLib())
    early_cuda.start({"device": "cuda"}).join(timeout=30)
    assert calls == ["cuInit", "cuDeviceGet"]
    assert early_cuda.report()["status"] == "failed" and "error 100" in early_cuda.report()["error"]
    calls.clear()
    monkeypatch.setattr(FakeLib, "__getattr__", lambda self, name: (lambda *a: calls.append(name) or 0))
    early_cuda.start({"device": "cuda:1"}).join(timeout=30)
    assert calls == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    assert early_cuda.report() | {"seconds": 0} == {"status": "created", "device": 1, "seconds": 0}
