"""The startup manifest: every phase timed, weights accounted for, and the KV pool beside the ledger's
prediction for it (the same arithmetic, so they must agree exactly)."""

from __future__ import annotations

import pytest

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
