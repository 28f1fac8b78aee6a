"""Environment switches: declared in one table, read once, re-read on request, listed when set."""

from __future__ import annotations

import pytest

from dsaserve.common import envs


def test_a_switch_flipped_after_startup_counts_only_after_reload(monkeypatch):
    monkeypatch.delenv("DSASERVE_PDL", raising=False)
    envs.reload()
    assert envs.DSASERVE_PDL is True and "DSASERVE_PDL" not in envs.set_switches()
    monkeypatch.setenv("DSASERVE_PDL", "0")
    assert envs.DSASERVE_PDL is True  # read once
    envs.reload()
    assert envs.DSASERVE_PDL is False and envs.set_switches()["DSASERVE_PDL"] == "0"
    monkeypatch.undo()
    envs.reload()


def test_values_are_parsed_as_the_code_used_them(set_switch):
    set_switch("DSASERVE_KERNELS", " Reference ")
    set_switch("DSASERVE_CACHE_DIR", "")
    assert envs.DSASERVE_KERNELS == "reference" and envs.DSASERVE_CACHE_DIR is None


def test_every_dsaserve_variable_the_package_reads_is_declared_here():
    import pathlib
    import re

    root = pathlib.Path(envs.__file__).parents[1]
    named = {m for p in root.rglob("*.py") for m in re.findall(r"DSASERVE_[A-Z0-9_]+", p.read_text())}
    assert named <= set(envs.SWITCHES)


def test_every_switch_is_in_the_readme():
    import pathlib
    import re

    readme = (pathlib.Path(envs.__file__).parents[2] / "README.md").read_text()
    assert [name for name in envs.SWITCHES if not re.search(rf"\b{name}\b", readme)] == []


def test_an_unknown_switch_is_an_attribute_error():
    with pytest.raises(AttributeError):
        _ = envs.DSASERVE_NOT_A_SWITCH


def test_override_changes_switches_for_a_block_without_writing_os_environ(set_switch):
    import os

    set_switch("DSASERVE_FP8_ACTIVATIONS", "1")
    environ = dict(os.environ)
    with envs.override(DSASERVE_FP8_ACTIVATIONS="0", DSASERVE_PDL="0"):
        assert envs.DSASERVE_FP8_ACTIVATIONS == "0" and envs.DSASERVE_PDL is False
        assert dict(os.environ) == environ
    assert envs.DSASERVE_FP8_ACTIVATIONS == "1" and envs.DSASERVE_PDL is True
    with pytest.raises(RuntimeError), envs.override(DSASERVE_FP8_ACTIVATIONS="0"):
        raise RuntimeError("a setting failed")
    assert envs.DSASERVE_FP8_ACTIVATIONS == "1" and dict(os.environ) == environ
    with pytest.raises(KeyError, match="DSASERVE_NOPE"), envs.override(DSASERVE_NOPE="1"):
        pass
