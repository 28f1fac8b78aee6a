"""bench/startup_cold_warm.py's scenarios without a server: which caches and switches each start gets."""

from __future__ import annotations

from bench.startup_cold_warm import SCENARIOS, scenario_env


def test_scenarios_share_caches_as_described(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.setenv("DSASERVE_WARMUP_CORES_ONLY", "1")
    monkeypatch.setenv("DSASERVE_WARM_START", "0")
    caches: dict = {}
    envs = {name: scenario_env(name, caches, tmp_path, tmp_path / "specs.jsonl") for name in SCENARIOS}
    assert envs["cold_serial"]["DSASERVE_CACHE_DIR"] != envs["cold_parallel"]["DSASERVE_CACHE_DIR"]
    assert envs["warm"]["DSASERVE_CACHE_DIR"] == envs["warm_cores"]["DSASERVE_CACHE_DIR"] \
        == envs["cold_parallel"]["DSASERVE_CACHE_DIR"]
    assert all("TRITON_CACHE_DIR" not in e for e in envs.values())  # the scenario's cache, not the caller's
    assert envs["cold_serial"]["DSASERVE_PRECOMPILE"] == "0"
    assert envs["cold_parallel"]["DSASERVE_KERNEL_SPECS"] == str(tmp_path / "specs.jsonl")
    assert "DSASERVE_WARMUP_CORES_ONLY" not in envs["warm"] and envs["warm_cores"]["DSASERVE_WARMUP_CORES_ONLY"] == "1"
    assert envs["warm_off"]["DSASERVE_CACHE_DIR"] == envs["warm"]["DSASERVE_CACHE_DIR"]
    assert envs["warm_off"]["DSASERVE_WARM_START"] == "0" and "DSASERVE_WARM_START" not in envs["warm"]


def test_a_scenario_whose_source_did_not_run_gets_its_own_caches(tmp_path):
    caches: dict = {}
    env = scenario_env("warm", caches, tmp_path, tmp_path / "s")
    assert env["DSASERVE_CACHE_DIR"] == str(tmp_path / "warm")
