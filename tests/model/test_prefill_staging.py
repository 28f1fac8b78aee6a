"""model/layers/prefill_staging.py: which steps stage their rows, what is staged, and that sparse MLA over the
staged rows reads what it reads from the cache itself (reference ops standing in for the GPU's, so it runs on
the CPU; the Triton kernels' own test is tests/kernels/test_gpu_kv_stage.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dsaserve.common import envs
from dsaserve.common.kv_layout import BF16, encode_latent
from dsaserve.config import load_config
from dsaserve.engine.kv_pool import KVPool
from dsaserve.kernels import reference as R
from dsaserve.model.forward_batch import ForwardBatch
from dsaserve.model.layers import prefill_staging
from dsaserve.model.layers.context import StepContext

PS = 64
CFG = load_config("glm-5.3-slice")  # kv_lora 512 + rope 64: the staged rows' width
OPS = SimpleNamespace(stage_latent=R.stage_latent, remap_slots=R.remap_slots, impls={"stage_latent": "gpu stand-in"})


def _step(seq_lens: list[int], tables: list[list[int]], new_tokens: int, layout: str = "fp8_ds_mla",
          ops=OPS) -> StepContext:
    pool = KVPool(CFG, 16, layout, [0], PS)
    gen = torch.Generator().manual_seed(0)
    pool.kv_cache(0).copy_(encode_latent(torch.randn(16 * PS, 576, generator=gen), layout, 512))
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    ext = [new_tokens // len(seq_lens)] * len(seq_lens)
    t = sum(ext)
    batch = ForwardBatch(torch.zeros(t, dtype=torch.int64), torch.zeros(t, dtype=torch.int64),
                         torch.zeros(t, dtype=torch.int64), torch.tensor(seq_lens), torch.tensor(ext), table,
                         torch.zeros(t, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), PS, seq_lens, ext)
    return StepContext(batch, pool, None, None, ops)


@pytest.fixture(autouse=True)
def small_steps(monkeypatch):
    monkeypatch.setattr(prefill_staging, "MIN_TOKENS", 4)


def test_each_requests_pages_are_staged_in_order_and_mapped_back():
    ctx = _step([130, 70], [[9, 2, 14], [5, 11, 0]], new_tokens=200)
    s = prefill_staging.for_step(ctx, 512)
    assert s.pages.tolist() == [9, 2, 14, 5, 11]  # 3 pages for 130 tokens, 2 for 70; the padding page is not
    assert {p: i for i, p in enumerate(s.pages.tolist())} == {p: int(s.page_map[p]) for p in (9, 2, 14, 5, 11)}
    assert int((s.page_map >= 0).sum()) == 5 and tuple(s.rows.shape) == (5 * PS, 576)
    assert prefill_staging.for_step(ctx, 512) is s  # decided once a step


@pytest.mark.parametrize("why", ["few tokens", "long context", "bf16 cache", "reference ops", "switched off",
                                 "other latent width"])
def test_steps_that_read_the_cache_themselves(why):
    kw = {"few tokens": {"new_tokens": 2}, "long context": {"new_tokens": 4},
          "bf16 cache": {"layout": "bf16"},
          "reference ops": {"ops": SimpleNamespace(impls={"stage_latent": "reference"})}}.get(why, {})
    ctx = _step([130, 70], [[9, 2, 14], [5, 11]], **{"new_tokens": 200, **kw})
    if why == "switched off":
        with envs.override(DSASERVE_PREFILL_STAGING="0"):
            assert prefill_staging.for_step(ctx, 512) is None
        return
    assert prefill_staging.for_step(ctx, 256 if why == "other latent width" else 512) is None
    assert ctx.staging is False  # decided: no staging for any layer of this step


def test_sparse_mla_over_staged_rows_reads_what_it_reads_from_the_cache():
    ctx = _step([130, 70], [[9, 2, 14], [5, 11]], new_tokens=40)  # 320 rows staged: 8 a token
    gen = torch.Generator().manual_seed(1)
    logical = [torch.randperm(130, generator=gen)[:40] for _ in range(3)] + \
              [torch.randperm(70, generator=gen)[:40] for _ in range(3)]
    slots = torch.stack([ctx.batch.slots_of(0 if i < 3 else 1, 130 if i < 3 else 70)[pos]
                         for i, pos in enumerate(logical)])
    slots[:, 30:] = -1  # a token that sees fewer keys than the top-k
    qn, qr = torch.randn(6, 4, 512, generator=gen), torch.randn(6, 4, 64, generator=gen)
    cache = ctx.pool.kv_cache(0)
    staging = prefill_staging.for_step(ctx, 512)
    rows, layout, staged = staging.stage(OPS, cache, ctx.pool.layout, slots, 512)
    assert layout == BF16 and bool((staged[:, 30:] == -1).all())
    got = R.sparse_mla_attention(qn, qr, rows, layout, staged, 0.04, 512)
    want = R.sparse_mla_attention(qn, qr, cache, ctx.pool.layout, slots, 0.04, 512)
    # bf16 rows: the FP32 dequantised value rounded once (the GPU kernels round it the same way)
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)
    assert staging.stage(OPS, cache, ctx.pool.layout, slots, 512)[2] is staged  # a shared layer reuses the remap
    assert staging.stage(OPS, cache, ctx.pool.layout, slots.clone(), 512)[2] is not staged  # a new selection
