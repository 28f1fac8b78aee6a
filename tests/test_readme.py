"""The README's examples run as written: every fenced bash command and Python snippet is taken from README.md.

- The install lines need a network: the test line must be what `.ci/run` runs, verbatim (CI runs it).
- `source .venv/bin/activate` puts `dsaserve` on PATH: here a shim for this interpreter does.
- Offline commands (`generate`, `make-checkpoint`, `ledger ...`) run in a scratch directory; what they write
  (`ckpt/`, `plots/`) must be git-ignored.
- `dsaserve serve` is started, then the `curl` lines run against it; so do the `bench serve` lines, with a
  smaller load appended (`--num-prompts 2 ...`; their full runs are tests/server/test_bench_serve.py's). The
  only edit to a command is the port: 8000 may be taken by anyone's server on a shared machine.
- The Python snippet runs as a script.
Any other bash line fails the test until it is classified here.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.harness import free_port

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
OFFLINE = ("dsaserve generate", "dsaserve make-checkpoint", "dsaserve ledger")
BENCH_SHRINK = ["--num-prompts", "2", "--input-len", "8", "--output-len", "2"]
TIMEOUT_S = 180


def fenced(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.S | re.M)


def bash_lines() -> list[str]:
    """Each command of the bash blocks, backslash continuations joined."""
    return [line.strip() for block in fenced("bash") for line in block.replace("\\\n", " ").splitlines()
            if line.strip()]


def argv(line: str, port: int | None = None) -> list[str]:
    words = shlex.split(line, comments=True)
    return [re.sub(r"(localhost|127\.0\.0\.1):8000", rf"\1:{port}", w) for w in words] if port else words


@pytest.fixture(scope="module")
def shell_env(tmp_path_factory) -> dict[str, str]:
    """The environment after `source .venv/bin/activate`: `dsaserve` on PATH (this interpreter's)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    shim = bin_dir / "dsaserve"
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m dsaserve "$@"\n')
    shim.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}


def run(cmd: list[str], env: dict[str, str], cwd: Path) -> str:
    r = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, f"{shlex.join(cmd)} exited {r.returncode}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def test_every_bash_line_is_one_this_file_knows():
    known = ("python3 -m venv .venv", "source .venv/bin/activate", "dsaserve serve", "curl ", "dsaserve bench serve",
             *OFFLINE)
    assert [line for line in bash_lines() if not line.startswith(known)] == []


def test_every_file_the_readme_points_to_is_in_the_repository():
    paths = set(re.findall(r"\]\(([^)#:]+)\)", README))  # markdown links
    paths |= {p for p in re.findall(r"`([\w./-]+\.(?:md|py))`", README) if "/" in p}  # `docs/X.md`, `bench/x.py`
    paths = {p if (REPO / p).exists() or p.startswith(("docs/", "bench/", "tests/", "../")) else f"dsaserve/{p}"
             for p in paths}
    assert sorted(p for p in paths if not (REPO / p).exists()) == []


def test_the_readme_test_line_is_what_ci_runs():
    install = [line for line in bash_lines() if line.startswith("python3 -m venv .venv")]
    assert len(install) == 2 and install[1].endswith(".venv/bin/python -m pytest tests")
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines() if line and not line.startswith("#")]
    assert install[1] in ci, ".ci/run no longer runs the README's test line verbatim"
    assert install[0].endswith(".venv/bin/dsaserve serve")  # serves the same built-in model as `dsaserve serve`


def test_offline_commands_run_and_their_outputs_are_git_ignored(shell_env, tmp_path):
    lines = [line for line in bash_lines() if line.startswith(OFFLINE)]
    assert len(lines) >= 6
    for line in lines:
        out = run(argv(line), shell_env, tmp_path)
        assert out.strip(), line
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == ["ckpt", "plots"]
    dirs = [name + "/" for name in made]  # as directories: `/ckpt/` in .gitignore matches only those
    ignored = subprocess.run(["git", "check-ignore", *dirs], cwd=REPO, capture_output=True, text=True)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.stdout.split() == dirs


def test_serve_then_curl_and_bench_against_it(shell_env, tmp_path):
    port = free_port()
    serve = next(line for line in bash_lines() if line.startswith("dsaserve serve"))
    cmd = argv(serve) + ["--port", str(port), "--log-level", "warning"]
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, env=shell_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_up(proc, port, tmp_path / "serve.log")
        for line in bash_lines():
            if line.startswith("curl "):
                assert run(argv(line, port), shell_env, tmp_path).strip(), line
            elif line.startswith("dsaserve bench serve"):
                out = run(argv(line, port) + BENCH_SHRINK, shell_env, tmp_path)
                assert re.search("Serving Benchmark Result|First Request", out), out
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_up(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"dsaserve serve exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200:
                return
        time.sleep(0.1)
    pytest.fail(f"dsaserve serve not Up within {TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def test_the_python_snippet_runs(shell_env, tmp_path):
    (snippet,) = fenced("python")
    out = run([sys.executable, "-c", snippet], shell_env, tmp_path)
    assert out  # it prints the streamed text
