"""`dsaserve serve`'s HTTP process starts without torch: everything it imports up to the launcher (checkpoint
resolution included; the checkpoint writer is imported only when a checkpoint is written) leaves torch
unloaded. The scheduler process is the one that pays for torch."""

from __future__ import annotations

import os
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


def test_serve_resolves_and_checks_everything_before_the_launcher_without_torch(tiny_checkpoint):
    """The whole of `dsaserve serve` up to launcher.run — flags, the cached checkpoint (a hit), its check, the
    layout check with the device resolved, spawning the children before the launcher's imports — imports no
    torch on a machine without GPUs (it cost the HTTP process 2-3 s of its start-up). The run is stopped at
    the launcher, which records what it got and stops the children it was handed."""
    tiny_checkpoint("glm-5.3-tiny")
    code = ("import sys\nimport dsaserve.server.launcher as L\n"
            "L.run = lambda args, clock, early: print(sorted(m for m in ('torch',) if m in sys.modules),"
            " list(clock.laps), clock.caches['model_files']['status'], sorted(early.children))"
            " or L.stop_children(early.children) or 0\n"
            "from dsaserve.cli import main\nsys.exit(main(['serve', '--model', 'glm-5.3-tiny']))")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU, whatever machine runs the tests
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.strip() == ("[] ['interpreter', 'cli_imports', 'resolve_model', 'spawn_processes', 'launcher_imports']"
                           " hit ['detokenizer', 'scheduler']")


def test_no_process_imports_jinja2_to_start_and_the_first_chat_template_does():
    """jinja2 (~50 ms) is for chat templates: the HTTP and detokenizer processes start without it (issue 16),
    and the first template rendered imports it."""
    code = ("import sys\nimport dsaserve.server.launcher, dsaserve.server.detokenizer_process\n"
            "print('jinja2' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_scheduler_reads_the_ledgers_kv_arithmetic_without_the_report_builder():
    """The engine's manifest needs `ledger.kv` only; the package no longer imports its report builder with it
    (~80 ms of the scheduler's start-up), nor does the dummy loader's writer import tokenizers or safetensors'
    writer. The package's names still resolve on first use."""
    code = ("import sys\nimport dsaserve.ledger.kv, dsaserve.weights.checkpoint_writer\n"
            "lazy = ('dsaserve.ledger.build', 'tokenizers', 'safetensors.torch')\n"
            "print(sorted(m for m in lazy if m in sys.modules))\n"
            "from dsaserve.ledger import SECTIONS, build_report, get_hardware\n"
            "import dsaserve.ledger as L\nprint(callable(build_report), L.get_hardware is get_hardware)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split("\n")[:2] == ["[]", "True True"]
