"""engine/early_cuda.py: which GPU a rank's early context is for (the rule `local_device` applies after torch:
the two agree, or the early context is not made), the switch, and a machine without libcuda (the thread fails
quietly; torch makes the context later, as before)."""

from __future__ import annotations

import os

import pytest

from dsaserve.common import envs
from dsaserve.engine import early_cuda


class NoDriver:
    def __init__(self, name):
        raise OSError(f"{name}: cannot open shared object file")


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "DSASERVE_EARLY_CUDA", "CUDA_MODULE_LOADING"):
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
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("LOCAL_RANK")
    monkeypatch.setenv("RANK", "3")
    assert early_cuda.device_ordinal({"device": "cuda"}) is None  # rank mod the GPU count: torch's to count
    monkeypatch.setenv("RANK", "0")
    assert early_cuda.device_ordinal({"device": "cuda"}) == 0  # 0 mod any count


@pytest.mark.parametrize(("device", "env", "gpus"), [
    ("cuda:3", {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1"}, 8),  # an index given wins
    ("cuda", {"WORLD_SIZE": "4", "RANK": "5", "LOCAL_RANK": "1"}, 8),  # LOCAL_RANK, not the rank
    ("cuda", {"WORLD_SIZE": "4", "RANK": "0"}, 8),  # neither: rank 0 is GPU 0
    ("cuda", {"WORLD_SIZE": "4", "RANK": "3"}, 2),  # neither: rank mod GPUs, known only to torch
    ("cuda", {"WORLD_SIZE": "1", "LOCAL_RANK": "2"}, 8),  # one rank: device 0, whatever LOCAL_RANK says
    ("cuda", {}, 8),  # nothing set: one process
])
def test_the_early_context_and_local_device_pick_the_same_gpu(monkeypatch, device, env, gpus):
    """One rule (distributed/rank_gpu.py): the early context's GPU is the one `local_device` gives the rank
    once torch is there, or there is no early context (no other GPU gets one)."""
    import torch

    from dsaserve.distributed.parallel_state import local_device

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(early_cuda.ctypes, "CDLL", NoDriver)  # the thread runs, and fails quietly
    after = local_device(device)
    assert after.type == "cuda" and after.index is not None
    early = early_cuda.start({"device": device})
    assert early.cuda and early.device == early_cuda.device_ordinal({"device": device})
    if early.device is None:  # torch's GPU count needed: no context made early, none on a wrong GPU
        assert early.thread is None and early_cuda.report()["status"] == "device not known before torch"
        assert after.index == int(env["RANK"]) % gpus
    else:
        early.thread.join(timeout=30)
        assert early.device == after.index


def test_no_device_given_follows_the_gpu_check(monkeypatch):
    monkeypatch.setattr("dsaserve.engine.engine_args.no_gpu_present", lambda: True)
    assert early_cuda.device_ordinal({}) is None
    monkeypatch.setattr("dsaserve.engine.engine_args.no_gpu_present", lambda: False)
    assert early_cuda.device_ordinal({"device": None}) == 0


def test_switched_off_and_cpu_ranks_start_nothing(monkeypatch):
    assert early_cuda.start({"device": "cpu"}) == early_cuda.Started(cuda=False)
    assert early_cuda.report()["status"] == "not a CUDA rank"
    monkeypatch.setenv("DSASERVE_EARLY_CUDA", "0")
    envs.reload()
    # off: no thread, but still a CUDA rank (its kernels are precompiled) on its GPU
    assert early_cuda.start({"device": "cuda:2"}) == early_cuda.Started(cuda=True, device=2)
    assert early_cuda.report()["status"] == "off"
    assert early_cuda.start({"device": "cpu"}).cuda is False


def test_a_driver_failure_is_reported_not_raised(monkeypatch):
    monkeypatch.setattr(early_cuda.ctypes, "CDLL", NoDriver)
    started = early_cuda.start({"device": "cuda"})
    assert started.cuda and started.device == 0 and started.thread is not None
    started.thread.join(timeout=30)
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
    early_cuda.start({"device": "cuda"}).thread.join(timeout=30)
    assert calls == ["cuInit", "cuDeviceGet"]
    assert early_cuda.report()["status"] == "failed" and "error 100" in early_cuda.report()["error"]
    calls.clear()
    monkeypatch.setattr(FakeLib, "__getattr__", lambda self, name: (lambda *a: calls.append(name) or 0))
    early_cuda.start({"device": "cuda:1"}).thread.join(timeout=30)
    assert calls == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain"]
    assert early_cuda.report() | {"seconds": 0} == {"status": "created", "device": 1, "seconds": 0}
