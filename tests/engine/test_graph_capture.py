"""engine/graph_capture.py: `capture_bucket`, one bucket's optional eager run and capture (with the warm start's retry).
The CUDA parts are stubbed: what is checked is the order of the calls and what is returned."""

from __future__ import annotations

import pytest
import torch

from dsaserve.engine.graph_capture import capture_bucket


@pytest.fixture(autouse=True)
def no_device_sync(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)


def _bucket(failures: int):
    calls: list[str] = []

    def warm():
        calls.append("warm")
        return {"collective_calls.all_reduce": 2.0}

    def capture():
        calls.append("capture")
        if calls.count("capture") <= failures:
            raise RuntimeError("operation not permitted when stream is capturing")
        return "graph"

    return calls, warm, capture


def test_a_bucket_warmed_first_is_captured_once():
    calls, warm, capture = _bucket(0)
    assert capture_bucket(warm, capture, True) == ({"collective_calls.all_reduce": 2.0}, "graph", True, False)
    assert calls == ["warm", "capture"]


def test_without_its_eager_run_a_bucket_is_captured_straight_away():
    calls, warm, capture = _bucket(0)
    assert capture_bucket(warm, capture, False) == ({}, "graph", False, False)
    assert calls == ["capture"]


def test_a_capture_that_fails_without_its_eager_run_is_retried_after_one():
    calls, warm, capture = _bucket(1)
    assert capture_bucket(warm, capture, False) == ({"collective_calls.all_reduce": 2.0}, "graph", True, True)
    assert calls == ["capture", "warm", "capture"]


def test_a_capture_that_fails_after_its_eager_run_raises():
    calls, warm, capture = _bucket(1)
    with pytest.raises(RuntimeError, match="capturing"):
        capture_bucket(warm, capture, True)
    calls2, warm2, capture2 = _bucket(2)
    with pytest.raises(RuntimeError):  # the retry fails too
        capture_bucket(warm2, capture2, False)
    assert calls2 == ["capture", "warm", "capture"]
