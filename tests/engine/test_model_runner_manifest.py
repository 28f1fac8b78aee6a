"""The startup manifest: every phase timed, weights accounted for, and the KV pool beside the ledger's
prediction for it (the same arithmetic, so they must agree exactly)."""

from __future__ import annotations

import pytest
import torch

from dsaserve.engine.model_runner import ModelRunner


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16"])
def test_manifest_shows_phases_weights_and_the_pool_beside_the_ledger(layout):
    m = ModelRunner.from_kwargs("glm-5.3-tiny", kv_layout=layout, kv_cache_bytes=8 << 20).manifest()
    assert {"resolve_checkpoint", "load_weights", "kv_pool", "tokenizer"} <= set(m["startup_time"])
    assert m["weights"]["tensors_loaded"] > 0 and m["weights"]["not_loaded"]  # MTP off: listed, with a reason
    pool, ledger = m["kv_pool"], m["kv_pool_ledger"]
    assert ledger["matches_pool"] and ledger["bytes_per_token"] == pool["bytes_per_token"]
    assert pool["num_pages"] == (8 << 20) // (pool["bytes_per_token"] * 64)


def test_manifest_lists_the_switches_the_environment_set(set_switch):
    set_switch("DSASERVE_OVERLAP_INDEXER", "0")
    env = ModelRunner.from_kwargs("glm-5.3-tiny", kv_cache_bytes=8 << 20).manifest()["env"]
    assert env["DSASERVE_OVERLAP_INDEXER"] == "0" and all(k.startswith("DSASERVE_") for k in env)


def test_manifest_splits_load_weights_into_its_parts():
    m = ModelRunner.from_kwargs("glm-5.3-tiny", kv_cache_bytes=8 << 20).manifest()
    parts = m["weights"]["phases"]
    assert set(parts) == {"cuda_context", "build", "fill", "finalize"}
    assert sum(parts.values()) <= m["startup_time"]["load_weights"] + 1e-3
    assert m["early_cuda_context"]["status"]  # what the scheduler process's early context did (here: nothing)


@pytest.mark.parametrize(("status", "loads_after_capture", "ranks"),
                         [("hit", 5, 1), ("hit", 6, 1), ("miss", 5, 1), ("partial", 5, 1), ("hit", 5, 2)])
def test_prefill_warmup_runs_on_every_start(monkeypatch, tmp_path, status, loads_after_capture, ranks):
    """The chunk's eager prefill runs whether or not the preload covered the kernels (a preload hit reuses the
    memory profile, so nothing else ran a forward of that size before the first request), and the core shapes
    warm one per class only when the preload covers every kernel loaded since."""
    from types import SimpleNamespace

    from dsaserve.engine import model_runner as mr
    from dsaserve.engine.warm_start import WarmStart

    runs: list[list[int]] = []
    monkeypatch.setattr(mr, "warmup_prefill", lambda model, pool, sizes, *a: runs.append(sizes) or sizes)
    monkeypatch.setattr(mr, "warm_sampler", lambda *a: 0)
    warm = WarmStart({"test": status}, root=tmp_path)
    warm.preload_report, warm.loads_after_preload = {"status": status}, 5
    r = ModelRunner.__new__(ModelRunner)
    r.warm_start, r.startup_time, r.graphs, r.piecewise, r.warmed_prefill = warm, {}, None, None, []
    r.parallel = SimpleNamespace(world_size=ranks)
    r.args = SimpleNamespace(piecewise_tokens=[256, 512], disable_cuda_graph=True, speculative_algorithm=None)
    r.cfg = SimpleNamespace(index_topk=64, vocab_size=128, eos_token_ids=[1])
    r.max_model_len, r.chunked_prefill_size, r.dp_world, r.kv_pool, r.device = 1024, 512, 1, None, "cpu"
    r.model = SimpleNamespace(logits_dtype=lambda: torch.float32)
    r._jit_loads = lambda: loads_after_capture
    r._warmup_and_capture()
    assert runs == [[512, 513]]  # the chunk, and one token over the piecewise buckets
    assert "warmup" in r.startup_time and "prefill_warmup" not in r.warmed
    covered = status == "hit" and loads_after_capture == 5
    assert r.warmed["core_warmup"] == ("per class (preloaded)" if covered else "row sweep")
