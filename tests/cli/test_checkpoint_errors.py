"""A broken checkpoint is one line on stderr, `<command>: error: <message naming the file or tensor>`, and exit
status 2, from both `dsaserve generate` and `dsaserve serve` (serve checks the structure in its HTTP process,
before any child starts; a NaN weight is only seen by the scheduler's loader)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dsaserve.cli import main
from tests.server.harness import free_port
from tests.weights.broken_checkpoint import BREAKAGES, copy_checkpoint, nan_scale


@pytest.fixture()
def ckpt(tmp_path, tiny_checkpoint) -> Path:
    return copy_checkpoint(tiny_checkpoint("glm-5.3-tiny"), tmp_path / "ckpt")


def _one_error_line(err: str, command: str, pattern: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"dsaserve {command}: error: ") and re.search(pattern, lines[0]), lines[0]


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_generate_and_serve_name_the_culprit_in_one_line_and_exit_2(ckpt, breakage, capsys):
    pattern = BREAKAGES[breakage](ckpt)
    capsys.readouterr()
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-tokens", "2"]) == 2
    _one_error_line(capsys.readouterr().err, "generate", pattern)
    assert main(["serve", "--model", str(ckpt), "--port", "1"]) == 2  # fails before it binds anything
    _one_error_line(capsys.readouterr().err, "serve", pattern)


def test_generate_refuses_a_nan_scale_in_one_line(ckpt, capsys):
    pattern = nan_scale(ckpt)
    assert main(["generate", "--model", str(ckpt), "--prompt-ids", "1,2", "--max-tokens", "2"]) == 2
    _one_error_line(capsys.readouterr().err, "generate", pattern)


def test_a_random_bytes_config_is_one_line_from_the_installed_command(ckpt):
    pattern = BREAKAGES["config.json of random bytes"](ckpt)
    r = subprocess.run([sys.executable, "-m", "dsaserve", "serve", "--model", str(ckpt)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    _one_error_line(r.stderr, "serve", pattern)


def test_serve_refuses_a_nan_scale_in_one_line(ckpt):
    pattern = nan_scale(ckpt)  # structurally perfect: only the scheduler's loader sees it
    r = subprocess.run([sys.executable, "-m", "dsaserve", "serve", "--model", str(ckpt), "--port", str(free_port()),
                        "--log-level", "error"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert re.search(rf"^(dsaserve serve: )?error: .*{pattern}", r.stderr.strip().splitlines()[-1]), r.stderr
    assert "Traceback" not in r.stderr


def test_serve_without_a_tokenizer_is_one_line_before_any_child(ckpt, capsys):
    (ckpt / "tokenizer.json").unlink()
    assert main(["serve", "--model", str(ckpt), "--port", "1"]) == 2  # fails before it binds or spawns anything
    _one_error_line(capsys.readouterr().err, "serve", "tokenizer.json is missing")
