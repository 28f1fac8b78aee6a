"""bench/startup_cold_warm.py's scenarios without a server: which caches and switches each start gets."""

from __future__ import annotations

from bench.startup_cold_warm import SCENARIOS, scenario_env


def test_scenarios_share_caches_as_described(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.setenv("DSASERVE_WARMUP_CORES_ONLY", "1")
    monkeypatch.setenv("DSASERVE_WARM_START", "0")
    monkeypatch.setenv("DSASERVE_EARLY_CUDA", "0")
    caches: dict = {}
    envs = {name: scenario_env(name, caches, tmp_path, tmp_path / "specs.jsonl", tmp_path) for name in SCENARIOS}
    assert envs["cold_serial"]["DSASERVE_CACHE_DIR"] != envs["cold_parallel"]["DSASERVE_CACHE_DIR"]
    assert envs["warm"]["DSASERVE_CACHE_DIR"] == envs["warm_cores"]["DSASERVE_CACHE_DIR"] \
        == envs["cold_parallel"]["DSASERVE_CACHE_DIR"]
    assert all("TRITON_CACHE_DIR" not in e for e in envs.values())  # the scenario's cache, not the caller's
    assert envs["cold_serial"]["DSASERVE_PRECOMPILE"] == "0"
    assert envs["cold_parallel"]["DSASERVE_KERNEL_SPECS"] == str(tmp_path / "specs.jsonl")
    assert "DSASERVE_WARMUP_CORES_ONLY" not in envs["warm"] and envs["warm_cores"]["DSASERVE_WARMUP_CORES_ONLY"] == "1"
    assert envs["warm_off"]["DSASERVE_CACHE_DIR"] == envs["warm"]["DSASERVE_CACHE_DIR"]
    assert envs["warm_off"]["DSASERVE_WARM_START"] == "0" and "DSASERVE_WARM_START" not in envs["warm"]
    assert envs["warm_again"] == envs["warm"]  # the same start once more, on the same caches
    assert envs["warm_noearly"]["DSASERVE_EARLY_CUDA"] == "0" and "DSASERVE_EARLY_CUDA" not in envs["warm"]
    assert envs["warm_profiled"]["DSASERVE_STARTUP_PROFILE"] == str(tmp_path / "profile")
    assert envs["warm_profiled"]["DSASERVE_CACHE_DIR"] == envs["warm"]["DSASERVE_CACHE_DIR"]
    assert "DSASERVE_STARTUP_PROFILE" not in envs["warm"]


def test_the_table_reads_a_skipped_precompile_and_the_load_parts(capsys):
    from bench.startup_cold_warm import print_table

    row = {"scenario": "warm", "healthy_after_s": 4.9, "manifest_total_s": 4.6,
           "precompile": {"status": "skipped: every spec already compiled", "specs": 185},
           "warm_start": {"status": "hit", "preload": {"status": "hit", "specs": 92, "seconds": 0.3},
                          "memory_profile": "hit"},
           "warmed_shapes": {"core_warmup": "per class (preloaded)"}, "warmed_prefill_chunks": [8192, 8193],
           "phases": {"engine_imports": 2.3, "load_weights": 0.3, "total_s": 4.6},
           "load_weights_parts": {"cuda_context": 0.01, "build": 0.02, "fill": 0.2, "finalize": 0.05},
           "early_cuda": {"status": "created", "seconds": 0.31}, "after_up": {"kernel_compiles_after_up": 0}}
    print_table([row, {"scenario": "cold_parallel", "error": "RuntimeError: x"}])
    out = capsys.readouterr().out
    assert "skipped (185 known)" in out and "hit 92/0.3s prof hit class" in out
    assert "cuda_context 0.010" in out and "early CUDA context: created 0.31s" in out
    assert "prefill warmup: [8192, 8193]" in out and "RuntimeError: x" in out


def test_a_scenario_whose_source_did_not_run_gets_its_own_caches(tmp_path):
    caches: dict = {}
    env = scenario_env("warm", caches, tmp_path, tmp_path / "s", tmp_path)
    assert env["DSASERVE_CACHE_DIR"] == str(tmp_path / "warm")


def test_a_warm_start_must_answer_as_the_cold_one(capsys):
    from bench.startup_cold_warm import print_table, same_answer

    cold = {"text": " return", "token_logprobs": [-0.51, -1.25]}
    assert same_answer({"text": " return", "token_logprobs": [-0.5104, -1.25]}, cold) is True
    assert same_answer({"text": " return", "token_logprobs": [-0.52, -1.25]}, cold) is False  # a logprob moved
    assert same_answer({"text": " yield", "token_logprobs": [-0.51, -1.25]}, cold) is False
    assert same_answer({"text": " return", "token_logprobs": [float("nan"), -1.25]}, cold) is False  # non-finite
    assert same_answer(None, cold) is None
    print_table([{"scenario": "warm", "same_answer_as_cold": False}, {"scenario": "warm_again"}])
    out = capsys.readouterr().out
    assert "DIFFERS" in out
