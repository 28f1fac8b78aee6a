"""bench/profile_decode.py's A/B turns (no GPU, a stand-in runner): a setting that changes the decode graph classes
("fused132") rebuilds them on every turn, under that turn's setting, and the run ends on the default's classes."""

from __future__ import annotations

import types

import pytest

from bench import profile_decode as P
from dsaserve.kernels import variants


class _Graphs:
    def __init__(self, log: list, programs: int):
        self.log, self.programs = log, programs

    def capture(self):
        self.log.append(("capture", self.programs))


def _runner(log: list):
    r = types.SimpleNamespace(log=log)
    r.graphs = _Graphs(log, variants.FUSED_PROGRAMS)

    def rebuild():
        log.append(("rebuild", variants.FUSED_PROGRAMS))
        return _Graphs(log, variants.FUSED_PROGRAMS)

    r._capture_decode = rebuild
    r.forward = lambda batch: None
    return r


@pytest.fixture
def timed(monkeypatch):
    monkeypatch.setattr(P, "cuda_time", lambda fn: 0.001)
    monkeypatch.setattr(P, "pipelined_time", lambda fn: 0.001)
    monkeypatch.setattr(P.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(P, "get_ops", lambda device: types.SimpleNamespace())


def test_a_class_changing_setting_rebuilds_the_classes_each_turn(timed):
    log: list = []
    runner = _runner(log)
    runner.device = "cpu"
    times = P.ab_replays(runner, None, ["default", "fused132"], rounds=2)
    assert log == [("rebuild", 128), ("rebuild", 132), ("rebuild", 128), ("rebuild", 132), ("rebuild", 128)]
    assert variants.FUSED_PROGRAMS == 128 and runner.graphs.programs == 128
    assert times["default"] == [1.0, 1.0] and times["fused132 overlapped"] == [1.0, 1.0]


def test_other_settings_capture_the_same_classes_again(timed):
    log: list = []
    runner = _runner(log)
    runner.device = "cpu"
    P.ab_replays(runner, None, ["default", "fused64"], rounds=1)
    assert log == [("capture", 128)] * 3


def test_wide_graphs_cannot_share_a_rebuilding_ab(timed):
    runner = _runner([])
    runner.device = "cpu"
    with pytest.raises(ValueError, match="wide_graphs"):
        P.ab_replays(runner, None, ["default", "wide_graphs", "fused132"])
