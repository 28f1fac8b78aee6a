"""common/startup_profile.py: DSASERVE_STARTUP_PROFILE writes a pstats file and a text summary of the block."""

from __future__ import annotations

import pstats

import pytest

from dsaserve.common import envs
from dsaserve.common.startup_profile import profiled


def _busy_start_up_step() -> int:
    return sum(i * i for i in range(20000))


def test_off_by_default_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with envs.override(DSASERVE_STARTUP_PROFILE=""), profiled("startup-rank0"):
        _busy_start_up_step()
    assert list(tmp_path.iterdir()) == []


def test_the_block_is_profiled_even_when_it_fails(tmp_path):
    where = tmp_path / "prof"
    with envs.override(DSASERVE_STARTUP_PROFILE=str(where)), pytest.raises(RuntimeError), profiled("startup-rank1"):
        _busy_start_up_step()
        raise RuntimeError("start-up failed")
    stats = pstats.Stats(str(where / "startup-rank1.prof"))
    assert any(fn[2] == "_busy_start_up_step" for fn in stats.stats)
    text = (where / "startup-rank1.txt").read_text()
    assert "by cumulative" in text and "by tottime" in text and "_busy_start_up_step" in text
