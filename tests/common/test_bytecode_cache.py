"""common/bytecode_cache.py: where a start's bytecode is read and written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dsaserve.common import bytecode_cache, envs


@pytest.fixture
def clean_python_state(monkeypatch, tmp_path):
    """sys's bytecode settings and the two variables restored after the test, whatever enable() set."""
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    return tmp_path


def test_writable_packages_keep_pythons_default(clean_python_state, monkeypatch):
    monkeypatch.setattr(bytecode_cache, "_writable_in_place", lambda d: True)
    assert bytecode_cache.enable()["status"] == "in place"
    assert sys.pycache_prefix is None and "PYTHONPYCACHEPREFIX" not in os.environ


def test_read_only_packages_cache_under_the_dsaserve_cache(clean_python_state, monkeypatch):
    monkeypatch.setattr(bytecode_cache, "_writable_in_place", lambda d: False)
    with envs.override(DSASERVE_CACHE_DIR=str(clean_python_state)):
        rep = bytecode_cache.enable()
    assert rep == {"status": "cached", "dir": str(clean_python_state / "pycache"), "why": "packages not writable"}
    assert sys.pycache_prefix == rep["dir"] and os.environ["PYTHONPYCACHEPREFIX"] == rep["dir"]
    assert bytecode_cache.report() == rep


def test_disabled_writing_is_cached_under_the_dsaserve_cache(clean_python_state, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    with envs.override(DSASERVE_CACHE_DIR=str(clean_python_state)):
        rep = bytecode_cache.enable()
    assert rep["status"] == "cached" and rep["why"] == "writing disabled"
    assert sys.dont_write_bytecode is False and "PYTHONDONTWRITEBYTECODE" not in os.environ


def test_switch_off_and_a_users_prefix_are_left_alone(clean_python_state, monkeypatch):
    monkeypatch.setattr(bytecode_cache, "_writable_in_place", lambda d: False)
    with envs.override(DSASERVE_PYCACHE="0"):
        assert bytecode_cache.enable() == {"status": "off"}
    monkeypatch.setattr(sys, "pycache_prefix", "/somewhere")
    assert bytecode_cache.enable() == {"status": "prefix set", "dir": "/somewhere"}
    assert sys.pycache_prefix == "/somewhere"


def test_a_second_process_reads_what_the_first_compiled(tmp_path):
    """PYTHONDONTWRITEBYTECODE=1 (as container images set it): the first process writes the module's bytecode under
    the cache, the second finds it there (no source compile)."""
    (tmp_path / "pkgdir").mkdir()
    (tmp_path / "pkgdir" / "some_module.py").write_text("VALUE = 42\n")
    code = ("import json, sys; from dsaserve.common import bytecode_cache; rep = bytecode_cache.enable(); "
            f"sys.path.insert(0, {str(tmp_path / 'pkgdir')!r}); import some_module, importlib.util; "
            "print(json.dumps([rep, some_module.VALUE, importlib.util.cache_from_source(some_module.__file__)]))")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "DSASERVE_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    def start() -> list:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.splitlines()[-1])

    rep, value, pyc = start()
    assert rep["status"] == "cached" and value == 42
    assert pyc.startswith(str(tmp_path / "cache" / "pycache")) and os.path.isfile(pyc)
    written = os.stat(pyc).st_mtime_ns
    assert start()[2] == pyc and os.stat(pyc).st_mtime_ns == written  # read, not compiled and written again
    assert not (tmp_path / "pkgdir" / "__pycache__").exists()  # nothing written beside the sources
