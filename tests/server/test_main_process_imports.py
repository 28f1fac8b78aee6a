"""`dsaserve serve`'s HTTP process starts without torch: everything it imports up to the launcher (checkpoint
resolution included; the checkpoint writer is imported only when a checkpoint is written) leaves torch
unloaded. The scheduler process is the one that pays for torch."""

from __future__ import annotations

import subprocess
import sys

MAIN_PROCESS_MODULES = ("dsaserve.cli.serve", "dsaserve.engine.engine_args", "dsaserve.weights.checkpoint_cache",
                        "dsaserve.server.launcher", "dsaserve.server.api", "dsaserve.server.tokenizer_manager")


def test_the_http_process_imports_no_torch():
    code = (f"import sys\nfor m in {MAIN_PROCESS_MODULES!r}: __import__(m)\n"
            "print(sorted(m for m in ('torch', 'safetensors.torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_cache_checks_the_index_file_the_writer_writes():
    from dsaserve.weights import checkpoint_cache, checkpoint_writer

    assert checkpoint_cache.INDEX_FILE == checkpoint_writer.INDEX_FILE
