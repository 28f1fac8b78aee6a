"""Server test harness: the real `dsaserve serve` in a subprocess on 127.0.0.1 and a free port, and the
helpers the server tests share (scrape /metrics, poll the scheduler until idle).

Every server is stopped at teardown (SIGTERM, then SIGKILL); its children die with it (they watch their
parent). Waits are bounded so a broken server fails a test instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL = "glm-5.3-tiny"
START_TIMEOUT_S = 120.0  # cold start on a 2-core CI machine: torch import + building the tiny checkpoint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, log_dir: Path, *extra: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "dsaserve", "serve", "--model", MODEL, "--port", str(self.port),
               "--log-level", "warning", *extra]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def log_tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def get(self, path: str, **kw) -> httpx.Response:
        return httpx.get(self.url + path, timeout=kw.pop("timeout", 30.0), **kw)

    def wait_listening(self, timeout: float = START_TIMEOUT_S) -> None:
        self._wait(lambda r: True, timeout, "listen")

    def wait_up(self, timeout: float = START_TIMEOUT_S) -> None:
        self._wait(lambda r: r.status_code == 200, timeout, "be Up")

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode} before it could {what}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if ok(self.get("/health", timeout=10.0)):
                    return
            time.sleep(0.05)
        pytest.fail(f"server did not {what} within {timeout} s:\n{self.log_tail()}")

    def pids(self) -> dict[str, int]:
        return self.get("/startup").json()["processes"]

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode


def alive(pid: int) -> bool:
    """A process that exited counts as dead even while it is an unreaped zombie (containers without an init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def admin_stats(server: ServerProcess, check_leak: bool = False) -> dict:
    r = server.get("/admin/stats", params={"check_leak": str(check_leak).lower()})
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(server: ServerProcess, timeout: float = 20.0) -> dict:
    """Poll until the scheduler has no request and no page in use; returns the last stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = admin_stats(server)
        st = s["stats"]
        if st["num_running"] == 0 and st["num_waiting"] == 0 and st["kv_pages_used"] == 0:
            return s
        if time.monotonic() > deadline:
            pytest.fail(f"scheduler not idle after {timeout} s: {st}")
        time.sleep(0.05)


def scrape(server) -> tuple[dict[str, str], dict[tuple[str, tuple], float]]:
    r = server.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    types, samples = {}, {}
    for fam in text_string_to_metric_families(r.text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return types, samples


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)
