"""bench/sparse_mla_sweep.py, the scaffolding both sparse MLA sweeps run on (the GPU parts run on the device): the
command line's config check and the parallel precompile's failure report."""

from __future__ import annotations

import sys

import pytest
import torch

from bench import sparse_mla_sweep as SW
from bench import sweep_sparse_mla_swap, sweep_sparse_mla_tc


@pytest.mark.parametrize("sweep", [sweep_sparse_mla_swap, sweep_sparse_mla_tc])
def test_main_rejects_an_unknown_config_before_compiling_anything(monkeypatch, sweep):
    monkeypatch.setattr(sys, "argv", ["sweep", "--only", "default,nope"])
    never = pytest.fail  # any step after the check would be a bug
    with pytest.raises(SystemExit, match="unknown config 'nope'"):
        SW.main("doc", sweep.CONFIGS, "x.json", precompile=never, check=never, timings=never, summary=never)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the jobs would compile")
def test_precompile_reports_each_failing_job_from_its_spawned_worker(capsys):
    """The kernel call reaches the workers (a module-level function, pickled by name); without CUDA each job
    fails there, and the failure comes back under the config's name instead of stopping the sweep."""
    failed = sweep_sparse_mla_tc.precompile(["default"], workers=1)
    assert set(failed) == {"None", "default"}  # None: the split-K kernel the tc sweep compares against
    assert all(err for err in failed.values())
    assert "compile/run FAILED default T=16" in capsys.readouterr().out
