"""`python -m pytest tests` alone sets what CI needs (OMP_WAIT_POLICY, a private cache) and leaves nothing in
the temp dir: not the checkpoint cache, not the IPC directory of a server killed with SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = '''
import json, os, subprocess, sys, tempfile

def test_probe(tiny_checkpoint):
    env = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "DSASERVE_CACHE_DIR", "TMPDIR")}
    print("ENV=" + json.dumps(env))
    # a server's main process that dies by SIGKILL after making its IPC directory
    code = "import os, tempfile; tempfile.mkdtemp(prefix='dsaserve-ipc-'); os.kill(os.getpid(), 9)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
'''


def test_a_test_run_sets_its_environment_and_leaves_no_files_behind(tmp_path):
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "test_probe.py").write_text(PROBE)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "DSASERVE_CACHE_DIR")}
    env.update(TMPDIR=str(tmp), PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-s",
                        str(tmp_path / "probe")], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    seen = next(line for line in r.stdout.splitlines() if "ENV=" in line)
    assert '"OMP_WAIT_POLICY": "PASSIVE"' in seen and f'"DSASERVE_CACHE_DIR": "{tmp}/dsaserve-test-' in seen
    assert list(tmp.iterdir()) == []
