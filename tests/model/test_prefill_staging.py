"""model/layers/prefill_staging.py: which steps stage their rows (the planning ledger's rule too), what is staged
(each distinct page once), that sparse MLA over the staged rows reads what it reads from the cache itself, that
each forward (eager, piecewise, MTP) stages its own pages, and what the memory profile reserves for it (reference
ops standing in for the GPU's, so it runs on the CPU; the Triton kernels' own test is
tests/kernels/test_gpu_kv_stage.py)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from dsaserve.common import envs
from dsaserve.common.causal import STAGING_MIN_TOKENS, topk_selected
from dsaserve.common.counters import COUNTERS
from dsaserve.common.kv_layout import BF16, encode_latent, get_kv_layout
from dsaserve.config import load_config
from dsaserve.engine.kv_pool import KVPool
from dsaserve.engine.memory_profile import dummy_prefill
from dsaserve.engine.piecewise_runner import PiecewiseRunner
from dsaserve.kernels import reference as R
from dsaserve.kernels.registry import get_ops
from dsaserve.ledger.deployment import Assumptions, Workload
from dsaserve.ledger.kv import kv_per_token
from dsaserve.ledger.prefill import kv_traffic
from dsaserve.model.forward_batch import ForwardBatch, contiguous_batch
from dsaserve.model.glm_moe_dsa import DsaForCausalLM
from dsaserve.model.layers import prefill_staging
from dsaserve.model.layers.context import StepContext
from dsaserve.weights.loader import load_dummy

PS = 64
CFG = load_config("glm-5.3-slice")  # kv_lora 512 + rope 64: the staged rows' width
OPS = SimpleNamespace(stage_latent=R.stage_latent, remap_slots=R.remap_slots, impls={"stage_latent": "gpu stand-in"})


def _step(seq_lens: list[int], tables: list[list[int]], new_tokens: int, layout: str = "fp8_ds_mla",
          ops=OPS, pool_pages: int = 16) -> StepContext:
    pool = KVPool(CFG, pool_pages, layout, [0], PS)
    gen = torch.Generator().manual_seed(0)
    pool.kv_cache(0).copy_(encode_latent(torch.randn(pool_pages * PS, 576, generator=gen), layout, 512))
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


def test_each_page_the_requests_attend_to_is_staged_and_mapped_back():
    ctx = _step([130, 70], [[9, 2, 14], [5, 11, 0]], new_tokens=200)
    s = prefill_staging.for_step(ctx, 512)
    assert s.pages.tolist() == [2, 5, 9, 11, 14]  # 3 pages for 130 tokens, 2 for 70; the padding page is not
    assert {p: i for i, p in enumerate(s.pages.tolist())} == {p: int(s.page_map[p]) for p in (9, 2, 14, 5, 11)}
    assert int((s.page_map >= 0).sum()) == 5 and tuple(s.rows.shape) == (5 * PS, 576)
    assert prefill_staging.for_step(ctx, 512) is s  # decided once a step


def test_the_page_list_built_on_the_host_is_the_device_tables():
    """The host's copy of the page table gives the list `torch.unique` of the device's did, to the bit: sorted,
    int32, each page once (requests sharing pages, padding columns, a page table wider than every request)."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        b = int(torch.randint(1, 5, (1,), generator=gen))
        seq_lens = torch.randint(1, 600, (b,), generator=gen).tolist()
        width = -(-max(seq_lens) // PS) + int(torch.randint(0, 3, (1,), generator=gen))
        table = torch.randint(0, 24, (b, width), generator=gen)  # shared and repeated pages
        host = prefill_staging._distinct_pages(table, seq_lens, PS, host_table=table.clone())
        device = prefill_staging._distinct_pages(table, seq_lens, PS)
        assert host.dtype == device.dtype == torch.int32 and torch.equal(host, device)


def test_a_device_batch_plans_from_the_hosts_page_table_without_reading_the_devices():
    """A host batch moved to the device keeps its page table on the host (ForwardBatch.to), and the plan reads
    that one: here the device is `meta`, whose tensors have no values, so any read of the device's table (the
    `torch.unique` that synced the host once a staged step) would raise; the plan's own tensors are the device's."""
    ctx = _step([130, 70], [[9, 2, 14], [5, 11, 0]], new_tokens=200)
    host_table = ctx.batch.page_table
    ctx.batch = ctx.batch.to("meta")
    assert ctx.batch.page_table.is_meta and ctx.batch.page_table_cpu is host_table
    with pytest.raises(NotImplementedError):  # the device's table alone: unreadable here
        prefill_staging._distinct_pages(ctx.batch.page_table, [130, 70], PS)
    s = prefill_staging.for_step(ctx, 512)
    assert s.pages.is_meta and s.page_map.is_meta and s.rows.is_meta
    assert s.pages.numel() == 5 and tuple(s.rows.shape) == (5 * PS, 576)  # as from the table itself (above)


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


def test_a_forward_being_captured_into_a_cuda_graph_never_stages(monkeypatch):
    """A decode graph's capture may reach MIN_TOKENS rows: its page list would be frozen into the graph and its
    host copies cannot be captured. (The CPU captures nothing: a page table that says it is on CUDA stands in.)"""
    ctx = _step([130, 70], [[9, 2, 14], [5, 11]], new_tokens=200)
    ctx.batch.page_table = SimpleNamespace(is_cuda=True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert prefill_staging.for_step(ctx, 512) is None and ctx.staging is False


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
    enabled, COUNTERS.enabled = COUNTERS.enabled, True
    try:
        before = COUNTERS.get("kv_bytes_staged")
        assert staging.stage(OPS, cache, ctx.pool.layout, slots, 512)[2] is staged  # a shared layer reuses the remap
        assert COUNTERS.get("kv_bytes_staged") - before == 5 * PS * (656 + 1152)  # 5 pages read, written as bf16
    finally:
        COUNTERS.enabled = enabled
    assert staging.stage(OPS, cache, ctx.pool.layout, slots.clone(), 512)[2] is not staged  # a new selection


def test_a_page_two_requests_share_is_staged_once():
    """A prefix-cache hit: both requests attend to pages 9 and 2. Staged once per request, they were read, written
    and counted twice, and held two copies in the buffer (6 pages staged for 4)."""
    ctx = _step([150, 140], [[9, 2, 14], [9, 2, 11]], new_tokens=48)  # the rule: 6 pages = 384 rows <= 8 x 48
    staging = prefill_staging.for_step(ctx, 512)
    pages = staging.pages.tolist()
    assert sorted(pages) == [2, 9, 11, 14] and tuple(staging.rows.shape) == (4 * PS, 576)
    assert [int(staging.page_map[p]) for p in pages] == [0, 1, 2, 3]
    gen = torch.Generator().manual_seed(2)
    slots = torch.stack([ctx.batch.slots_of(r, n)[torch.randperm(n, generator=gen)[:40]]
                         for r, n in ((0, 150), (0, 150), (1, 140), (1, 140))])
    qn, qr = torch.randn(4, 4, 512, generator=gen), torch.randn(4, 4, 64, generator=gen)
    cache = ctx.pool.kv_cache(0)
    enabled, COUNTERS.enabled = COUNTERS.enabled, True
    try:
        before = COUNTERS.get("kv_bytes_staged")
        rows, layout, staged = staging.stage(OPS, cache, ctx.pool.layout, slots, 512)
        assert COUNTERS.get("kv_bytes_staged") - before == 4 * PS * (656 + 1152)
    finally:
        COUNTERS.enabled = enabled
    got = R.sparse_mla_attention(qn, qr, rows, layout, staged, 0.04, 512)
    want = R.sparse_mla_attention(qn, qr, cache, ctx.pool.layout, slots, 0.04, 512)
    assert torch.allclose(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("prefix, tokens", [(0, 512), (0, STAGING_MIN_TOKENS - 1), (3584, 512), (3585, 512),
                                            (1000, 700)])
def test_the_engine_stages_what_the_planning_ledger_counts(monkeypatch, prefix: int, tokens: int):
    """One request's chunk, as the planning ledger models a prefill (ledger/prefill.py): the engine stages the
    rows the ledger counts, and none where the ledger says the chunk reads the cache (under 512 tokens; 3585 +
    512 tokens fill 65 pages, past 8 rows a token)."""
    monkeypatch.setattr(prefill_staging, "MIN_TOKENS", STAGING_MIN_TOKENS)
    seq, pages = prefix + tokens, -(-(prefix + tokens) // PS)
    staging = prefill_staging.for_step(_step([seq], [list(range(pages))], tokens, pool_pages=pages), 512)
    asm = Assumptions()
    per_tok = kv_per_token(CFG, "fp8_ds_mla", asm)
    _, staged, _ = kv_traffic(CFG, Workload(), asm, per_tok, prefix, tokens, topk_selected(prefix, tokens, 2048))
    assert staged == (0 if staging is None else staging.rows.shape[0]) * (656 + 1152) * CFG.num_hidden_layers
    assert (staging is not None) == ((prefix, tokens) in ((0, 512), (3584, 512), (1000, 700)))


@pytest.fixture(scope="module")
def model_512() -> DsaForCausalLM:
    """glm-5.3-tiny at the real latent width (kv_lora 512, which staging needs): dummy weights, fp32, CPU."""
    cfg = dataclasses.replace(load_config("glm-5.3-tiny"), kv_lora_rank=512)
    model = DsaForCausalLM(cfg)
    load_dummy(model, 0)
    model.finalize(torch.float32, torch.device("cpu"), keep_fp8=False)
    return model


def test_every_forward_stages_its_own_pages(model_512, monkeypatch):
    """Two chunks of two prompts, the second attending to pages the first had not written: each forward (the
    eager one; the piecewise runner's, whose cores run between segments; the MTP layer's) plans its staging
    once, of its own pages, and every slot a layer selects has a staged row (a staging carried over from the
    step before would drop the new pages' keys). Piecewise == eager to the bit; MTP's one layer ~ unstaged."""
    monkeypatch.setitem(get_ops("cpu").impls, "stage_latent", "gpu stand-in")  # reference ops stage on the CPU
    plans, lost = [], []
    plan, stage = prefill_staging._plan, prefill_staging.PrefillStaging.stage

    def planned(ctx, kv_lora_rank):
        staging = plan(ctx, kv_lora_rank)
        plans.append(None if staging is None else staging.pages.tolist())
        return staging

    def staged(self, ops, cache, layout, slots, kv_lora_rank):
        out = stage(self, ops, cache, layout, slots, kv_lora_rank)
        lost.append(int(((slots >= 0) & (out[2] < 0)).sum()))
        return out

    monkeypatch.setattr(prefill_staging, "_plan", planned)
    monkeypatch.setattr(prefill_staging.PrefillStaging, "stage", staged)
    model, cfg = model_512, model_512.cfg
    gen = torch.Generator().manual_seed(0)
    toks = [torch.randint(2, cfg.vocab_size, (n,), generator=gen).tolist() for n in (140, 90)]
    steps = [contiguous_batch([toks[0][:100], toks[1][:60]], [0, 0], [0, 10 * PS]),
             contiguous_batch([toks[0][100:], toks[1][60:]], [100, 60], [0, 10 * PS])]
    pool = lambda: KVPool(cfg, 16, "fp8_ds_mla", model.kv_layer_ids, PS, torch.float32, sink_pages=1)  # noqa: E731
    eager_pool = pool()
    eager = [model(b, eager_pool)[0] for b in steps]
    pw = PiecewiseRunner(model, pool(), sorted(b.num_tokens for b in steps), 8, 16)  # no padding rows: same bits
    pw.capture()  # off CUDA: the segments' warm runs, no core
    piecewise = [pw.forward(b) for b in steps]
    assert plans == [[0, 1, 10], [0, 1, 2, 10, 11]] * 2  # 2 + 1 pages, then 3 + 2: once a forward, its own
    assert len(lost) == 2 * 2 * cfg.num_hidden_layers and not any(lost)
    assert all(torch.equal(a, b) for a, b in zip(eager, piecewise, strict=True))

    plans.clear()
    nxt = contiguous_batch([toks[0][1:101], toks[1][1:61]], [0, 0], [0, 10 * PS])  # MTP over the first chunk
    hidden = model(steps[0], eager_pool)[1]
    mtp = model.forward_mtp(nxt, eager_pool, hidden)
    with envs.override(DSASERVE_PREFILL_STAGING="0"):
        unstaged = model.forward_mtp(nxt, eager_pool, hidden)
    assert plans == [[0, 1, 10], [0, 1, 10], None]  # the main forward's, the MTP layer's own, switched off: none
    assert float((mtp - unstaged).norm() / unstaged.norm()) < 1e-2  # bf16 rows: the FP32 value rounded once


def test_the_piecewise_core_batch_keeps_the_hosts_page_table(model_512):
    """The piecewise runner's core batch is views of its device buffer; the staging plans from the host batch's
    page table, which it carries (the padding columns it adds on the device are the sink page: never staged)."""
    pool = KVPool(model_512.cfg, 16, "fp8_ds_mla", model_512.kv_layer_ids, PS, torch.float32, sink_pages=1)
    batch = contiguous_batch([[3] * 100, [4] * 60], [0, 0], [0, 10 * PS])
    core = PiecewiseRunner(model_512, pool, [160], 8, 16)._stage(batch, 160)
    assert core.page_table_cpu is batch.page_table
    assert torch.equal(core.page_table[:, :batch.page_table.shape[1]], batch.page_table)


def test_the_memory_profile_reserves_what_its_dummy_prefill_did_not_stage():
    """The profile's prefill stages a context of its own length; a chunk deep into a long prompt stages up to
    ROWS_PER_TOKEN times as many bf16 rows. Steps that never stage reserve nothing."""
    fp8, bf16 = get_kv_layout("fp8_ds_mla"), get_kv_layout("bf16")
    rows = prefill_staging.ROWS_PER_TOKEN - 1
    assert prefill_staging.reserve_bytes(OPS, fp8, 512, 64, 8192) == rows * 8192 * 576 * 2
    assert prefill_staging.reserve_bytes(OPS, bf16, 512, 64, 8192) == 0
    assert prefill_staging.reserve_bytes(OPS, fp8, 256, 64, 8192) == 0
    assert prefill_staging.reserve_bytes(OPS, fp8, 512, 64, prefill_staging.MIN_TOKENS - 1) == 0
    assert prefill_staging.reserve_bytes(SimpleNamespace(impls={"stage_latent": "reference"}), fp8, 512, 64, 8192) == 0
    with envs.override(DSASERVE_PREFILL_STAGING="0"):
        assert prefill_staging.reserve_bytes(OPS, fp8, 512, 64, 8192) == 0


def test_the_reserve_and_the_dummy_prefills_own_staging_cover_the_largest_step():
    """The profile measures its dummy prefill, which stages its own pages; the reserve adds the rest, up to the
    ROWS_PER_TOKEN rows a token the rule lets a step stage (whole pages, each distinct page once)."""
    tokens = 1000
    ctx = _step([tokens], [list(range(16))], tokens)
    ctx.batch = dummy_prefill(tokens, PS, CFG.vocab_size, "cpu")
    own = prefill_staging.for_step(ctx, 512).rows.shape[0]
    assert own == 16 * PS  # 1000 tokens: 16 whole pages
    largest = prefill_staging.ROWS_PER_TOKEN * tokens  # the rule's bound on a step's rows
    reserve = prefill_staging.reserve_bytes(OPS, get_kv_layout("fp8_ds_mla"), 512, 64, tokens)
    assert own * 1152 + reserve >= largest * 1152 > (own - PS) * 1152 + reserve  # covered, and by under a page
