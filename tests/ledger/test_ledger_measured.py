"""`dsaserve ledger --measured`: a GPU run's decode steps (bench_gpu's JSON) against the ledger's bytes and bound,
the time model fitted to them, and bad run files named by field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dsaserve.cli import main
from dsaserve.ledger.measured import fit_time, load_measured, measured_rows, predictions

# glm-5.3-slice on one H200 (the thirty-first session)
RUN = str(Path(__file__).parents[2] / "bench/results/bench_gpu_call3_2026-12-05-thirtyfirst.json")


@pytest.fixture(scope="module")
def rows():
    return measured_rows(load_measured(RUN))


def test_the_ledger_counts_the_runs_bytes_and_every_step_is_past_its_bound(rows):
    assert len(rows) == 9
    for r in rows:  # bench_gpu counted the model's own bytes a step: weights, KV slots, indexer keys
        assert r["ledger_bytes"] == pytest.approx(r["run_bytes"], rel=1e-4)
        assert r["measured_s"] > r["bound_s"]  # a bound: no step beats it


def test_the_fit_recovers_a_known_time_model_exactly():
    truth = np.array([150e-6, 1 / 3.5e12, 1 / 1.2e12, 5e-6])
    rng = np.random.default_rng(0)
    fake = [{"weights": w, "kv": k, "batch": b} for w, k, b in
            zip(rng.uniform(4e9, 8e9, 8), rng.uniform(1e6, 7e9, 8), rng.integers(1, 256, 8), strict=True)]
    for r in fake:
        r["measured_s"] = float(np.array([1.0, r["weights"], r["kv"], r["batch"]]) @ truth)
    np.testing.assert_allclose(fit_time(fake), truth, rtol=1e-6)


def test_the_fit_of_the_run_carries_to_its_rows(rows):
    coef, fitted, loo = predictions(rows)
    assert (coef > 0).all() and len(fitted) == len(loo) == len(rows)
    assert all(abs(f / r["measured_s"] - 1) < 0.3 for f, r in zip(fitted, rows, strict=True))


def test_a_term_the_steps_do_not_support_gets_no_cost_not_a_negative_one():
    """Times that fall with the batch would give the per-request term a negative cost; it gets none, and no
    non-negative subset of the terms fits better."""
    fake = [{"weights": 5e9, "kv": 1e9 * b, "batch": b, "measured_s": 2e-3 + 1e-4 * b - 2e-5 * b * b}
            for b in range(1, 9)]
    a = np.array([[1.0, r["weights"], r["kv"], r["batch"]] for r in fake]) / np.array([r["measured_s"]
                                                                                       for r in fake])[:, None]
    assert np.linalg.lstsq(a, np.ones(len(fake)), rcond=None)[0].min() < 0  # plain least squares goes negative
    coef = fit_time(fake)
    res = float(np.sum((a @ coef - 1) ** 2))
    assert (coef >= 0).all() and (coef == 0).any()
    for keep in ([0], [1], [2], [3], [0, 2], [0, 3], [2, 3], [0, 2, 3]):
        sol = np.linalg.lstsq(a[:, keep], np.ones(len(fake)), rcond=None)[0]
        if (sol >= 0).all():
            assert res <= float(np.sum((a[:, keep] @ sol - 1) ** 2)) + 1e-12


def test_the_cli_reports_the_run_and_names_bad_fields(capsys, tmp_path):
    assert main(["ledger", "--measured", RUN, "--json", "--batch", "32", "--decode-context", "64K"]) == 0
    d = json.loads(capsys.readouterr().out)
    sec = d["sections"]["measured_steps"]
    assert [r["batch"] for r in sec["rows"]] == [1, 64, 128] * 3 and "time model" in sec["notes"][0]
    # between the run's batch-1 and batch-64 steps at 32K and 128K
    ms = float(sec["notes"][-1].split("gives ")[1].split(" ms")[0])
    assert "batch 32, context 65,536" in sec["notes"][-1] and 1.6 < ms < 5.2
    bad = tmp_path / "run.json"
    run = json.loads(Path(RUN).read_text())
    zero = [{**r, "overlapped_ms": 0.0} if i == 2 else r for i, r in enumerate(run["decode"])]
    for content, message in (("{", "not JSON"), ("{}", "no field 'manifest'"),
                             (json.dumps({**run, "decode": []}), "0 decode rows ran"),
                             (json.dumps({**run, "decode": zero}), "decode[2]: overlapped_ms must be a positive")):
        bad.write_text(content)
        assert main(["ledger", "--measured", str(bad)]) == 2
        assert message in capsys.readouterr().err
    assert main(["ledger", "--measured", RUN, "--reconcile", RUN]) == 2
    assert "not with --reconcile" in capsys.readouterr().err
