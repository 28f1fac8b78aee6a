"""A batch whose page table is at most index_topk keys wide takes every key: its full layers write their indexer
keys but compute no queries or head weights (`StepContext.all_keys`, `Indexer.prepare`), and the first full
layer's every-key selection serves the rest. The logits must equal those of the path that scores the keys (the
same set of slots, in another order), on the CPU reference kernels; a wider batch still scores.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.engine.kv_pool import KVPool
from dsaserve.kernels import reference as R
from dsaserve.model.forward_batch import contiguous_batch
from dsaserve.model.layers import indexer as indexer_module

PAGE = 4  # tiny configs select top-8: two pages


def _run(model, steps, skip: bool, monkeypatch) -> tuple[list[torch.Tensor], list[int]]:
    """Logits of each step (a fresh pool, the same steps) and how many wq_b calls each made."""
    monkeypatch.setattr(indexer_module, "SKIP_QUERIES_FOR_ALL_KEYS", skip)
    full = [layer.self_attn.indexer for layer in model.model.layers if layer.self_attn.indexer is not None]
    calls = [0]
    hooks = [ix.wq_b.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for ix in full]
    pool = KVPool(model.cfg, 16, "fp32", model.kv_layer_ids, PAGE, torch.float32, "cpu")
    logits, counts = [], []
    try:
        for batch in steps:
            calls[0] = 0
            logits.append(model(batch, pool)[0])
            counts.append(calls[0])
    finally:
        for h in hooks:
            h.remove()
    return logits, counts


@pytest.mark.parametrize("name", ["glm-5.3-tiny", "deepseek-v3.2-tiny"])
def test_a_batch_within_the_top_k_skips_the_indexer_queries(cpu_model, name, monkeypatch):
    model = cpu_model(name)
    cfg = model.cfg
    assert cfg.index_topk == 2 * PAGE and cfg.full_indexer_layers
    steps = [contiguous_batch([[3, 4, 5, 6, 7], [9, 10, 11]], [0, 0], [0, 32], PAGE),  # 2 pages: every key
             contiguous_batch([[8], [12]], [5, 3], [0, 32], PAGE),  # decode, 6 and 4 keys
             contiguous_batch([[13, 14, 15]], [6], [0], PAGE)]  # 9 keys, 3 pages: scored
    skipped, skipped_calls = _run(model, steps, True, monkeypatch)
    scored, scored_calls = _run(model, steps, False, monkeypatch)
    n_full = len(cfg.full_indexer_layers)
    assert skipped_calls == [0, 0, n_full] and scored_calls == [n_full] * 3
    for got, want in zip(skipped, scored, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the slots summed in another order


def test_the_reference_selection_without_queries_is_every_visible_key():
    page_table = torch.tensor([[5, 2], [7, 0]])
    positions = torch.tensor([0, 1, 2, 3, 4])  # request 0: a 3-token prefill; request 1: 2 new after 3 cached
    req = torch.tensor([0, 0, 0, 1, 1])
    out = R.indexer_topk(None, None, torch.empty(0), "fp32", page_table, req, positions, 8, 4, [3, 5], [3, 2])
    assert out[0].tolist() == [20, -1, -1, -1, -1, -1, -1, -1]
    assert out[2].tolist() == [20, 21, 22, -1, -1, -1, -1, -1]
    assert out[3].tolist() == [28, 29, 30, 31, -1, -1, -1, -1]  # position 3 of request 1: keys 0..3
    assert out[4].tolist() == [28, 29, 30, 31, 0, -1, -1, -1]
    with pytest.raises(ValueError, match="past top-4"):
        R.indexer_topk(None, None, torch.empty(0), "fp32", page_table, req, positions, 4, 4, [3, 5], [3, 2])


@pytest.mark.parametrize("name", ["glm-5.3-tiny", "deepseek-v3.2-tiny"])
def test_sparse_mla_hears_that_rows_are_full_only_for_one_token_past_the_top_k(cpu_model, name, monkeypatch):
    """`StepContext.full_topk`: sparse MLA may divide the top-k statically (`triton_sparse_mla.FULL_ROW_CONFIG`)
    only where every slot is valid: one token whose page table is wider than the top-k. Not a two-token batch (one
    row may be short), not a one-token batch within the top-k."""
    from dsaserve.kernels.registry import get_ops

    model = cpu_model(name)
    ops = get_ops("cpu")
    seen: list[bool] = []

    def spy(*args, full_rows=False, **kwargs):
        seen.append(full_rows)
        return R.sparse_mla_attention(*args, **kwargs)

    monkeypatch.setattr(ops, "sparse_mla_attention", spy)
    pool = KVPool(model.cfg, 16, "fp32", model.kv_layer_ids, PAGE, torch.float32, "cpu")
    n_layers = model.cfg.num_hidden_layers
    steps = [(contiguous_batch([list(range(3, 12))], [0], [0], PAGE), False),  # a 9-token prefill
             (contiguous_batch([[12]], [9], [0], PAGE), True),  # its decode: 10 keys past the top-8
             (contiguous_batch([[13], [5]], [10, 0], [0, 32], PAGE), False),  # one row of one key
             (contiguous_batch([[6]], [1], [32], PAGE), False)]  # 2 keys, one page: within the top-k
    for batch, full in steps:
        seen.clear()
        model(batch, pool)
        assert seen == [full] * n_layers, (batch.seq_lens, seen)
