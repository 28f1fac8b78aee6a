"""Shard rules without processes: a rank's layout is set directly (building and loading a model issues no
collective), so each rank's weights can be checked against the checkpoint slice it must hold — including
layouts with more ranks than CI can spawn (TP4 + EP2: experts split 2 ways, each expert's rows 2 ways).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsaserve.common.counters import COUNTERS, ring_wire_factor
from dsaserve.config import load_config
from dsaserve.distributed import collectives
from dsaserve.distributed.parallel_state import (
    Group,
    ParallelState,
    initialize_model_parallel,
    reset_parallel_state,
    set_parallel_state,
    validate_for_model,
)
from dsaserve.distributed.sharding import Shard, require_fp8_aligned
from dsaserve.kernels.reference import dequant_fp8_weight
from dsaserve.ledger.collective_plan import wire_factor as ledger_wire_factor
from dsaserve.model.glm_moe_dsa import DsaForCausalLM
from dsaserve.weights.fp8 import quantize_fp8_block
from dsaserve.weights.loader import load_checkpoint

GLM = "glm-5.3-tiny"


def _state(world: int, rank: int, tp: int, ep: int) -> ParallelState:
    group = lambda name, size: Group(name, size, rank if size > 1 else 0)  # noqa: E731
    return ParallelState(world_size=world, rank=rank, tp_size=tp, ep_size=ep, backend="none",
                         world=group("world", world), tp_group=group("tp", tp), moe_group=group("moe", world))


@pytest.fixture()
def layout():
    """layout(world, rank, tp, ep) sets this process's parallel state; reset afterwards."""
    yield lambda *a: set_parallel_state(_state(*a))
    reset_parallel_state()


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for fname in set(weight_map.values()):
        with safe_open(str(ckpt / fname), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def _dense(t: dict, name: str) -> torch.Tensor:
    w = t[f"{name}.weight"]
    return dequant_fp8_weight(w, t[f"{name}.weight_scale_inv"]) if w.dtype == torch.float8_e4m3fn else w.float()


def _load(ckpt: Path):
    model = DsaForCausalLM(load_config(ckpt), with_mtp=False)
    report = load_checkpoint(model, ckpt, progress=False)
    return model, report


def test_one_rank_collectives_are_noops_and_count_nothing():
    reset_parallel_state()
    x = torch.randn(4, 6)
    before = COUNTERS.snapshot()
    assert collectives.all_reduce(x) is x
    assert collectives.all_gather(x, dim=1) is x
    buf = torch.empty(4, 6)
    assert collectives.all_gather(x, dim=1, out=buf) is buf and torch.equal(buf, x)
    assert collectives.reduce_scatter(x) is x
    assert collectives.all_to_all(x, [4], [4]) is x
    assert collectives.broadcast(x) is x
    assert collectives.warmup("cpu") == []
    assert not [k for k in COUNTERS.diff(COUNTERS.snapshot(), before) if k.startswith("collective")]


def test_ring_factors_are_the_ledgers():
    assert ring_wire_factor("all_reduce", 8) == 2 * 7 / 8 and ring_wire_factor("broadcast", 8) == 7 / 8
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        for n in (1, 2, 8):
            assert ring_wire_factor(kind, n) == ledger_wire_factor(kind, n)


@pytest.mark.parametrize("dim", [0, 1])
def test_aligned_fp8_shard_with_its_scale_blocks_equals_the_dequantised_slice(dim):
    w = torch.randn(512, 384, generator=torch.Generator().manual_seed(0))
    q, s = quantize_fp8_block(w)
    shard = Shard(dim, 1, 2) if dim == 0 else Shard(dim, 2, 3)  # 256 rows / 128 columns: whole blocks
    assert shard.aligned(tuple(w.shape))
    assert torch.equal(dequant_fp8_weight(shard.take(q), shard.take_blocks(s)), shard.take(dequant_fp8_weight(q, s)))


def test_tp_rank_holds_its_vocab_rows_heads_and_mlp_rows(layout, tiny_checkpoint):
    ckpt = tiny_checkpoint(GLM)
    t = _tensors(ckpt)
    layout(2, 1, 2, 1)
    model, report = _load(ckpt)
    attn = model.model.layers[0].self_attn
    kv_b = "model.layers.0.self_attn.kv_b_proj"  # 4 heads x 64 rows: 128 rows per rank, whole FP8 blocks
    assert torch.equal(attn.kv_b_proj.weight.view(torch.uint8), t[f"{kv_b}.weight"][128:].view(torch.uint8))
    assert torch.equal(attn.kv_b_proj.weight_scale_inv, t[f"{kv_b}.weight_scale_inv"][1:])
    model.finalize(torch.float32, torch.device("cpu"), keep_fp8=False)
    p = "model.layers.0"
    assert attn.n_heads == 2
    assert torch.equal(model.model.embed_tokens.weight, t["model.embed_tokens.weight"][256:].float())
    assert torch.equal(model.lm_head.weight, t["lm_head.weight"][256:].float())
    # 96 q_b rows per rank are not whole 128-blocks: dequantised whole, then sliced
    assert torch.equal(attn.q_b_proj.weight, _dense(t, f"{p}.self_attn.q_b_proj")[96:])
    assert torch.equal(attn.o_proj.weight, _dense(t, f"{p}.self_attn.o_proj")[:, 64:])
    assert torch.equal(attn.q_a_proj.weight, _dense(t, f"{p}.self_attn.q_a_proj"))  # A projections replicated
    mlp = model.model.layers[0].mlp
    assert torch.equal(mlp.gate_proj.weight, _dense(t, f"{p}.mlp.gate_proj")[192:])
    assert torch.equal(mlp.down_proj.weight, _dense(t, f"{p}.mlp.down_proj")[:, 192:])
    idx = model.model.layers[0].self_attn.indexer
    assert torch.equal(idx.wq_b.weight, _dense(t, f"{p}.self_attn.indexer.wq_b"))  # indexer replicated
    assert report.tensors_loaded + len(report.not_loaded) == len(t)


def test_tp4_ep2_rank_holds_half_the_rows_of_half_the_experts(layout, tiny_checkpoint):
    """World 4 = TP4, EP2: rank 3 is EP rank 1 (experts 4-7) and holds the second half of their rows."""
    ckpt = tiny_checkpoint(GLM)
    t = _tensors(ckpt)
    layout(4, 3, 4, 2)
    model, report = _load(ckpt)
    model.finalize(torch.float32, torch.device("cpu"), keep_fp8=False)
    moe = model.model.layers[2].mlp
    for local, j in enumerate(range(4, 8)):
        e = f"model.layers.2.mlp.experts.{j}"
        want13 = torch.cat([_dense(t, f"{e}.gate_proj")[64:], _dense(t, f"{e}.up_proj")[64:]])
        assert torch.equal(moe.experts.w13[local], want13)
        assert torch.equal(moe.experts.w2[local], _dense(t, f"{e}.down_proj")[:, 64:])
    shared = "model.layers.2.mlp.shared_experts"
    assert torch.equal(moe.shared_experts.up_proj.weight, _dense(t, f"{shared}.up_proj")[96:])
    skipped = {k for k in report.not_loaded if ".experts." in k and not k.startswith("model.layers.6.")}
    assert skipped == {f"model.layers.{layer}.mlp.experts.{j}.{p}_proj.{s}" for layer in range(2, 6)
                       for j in range(4) for p in ("gate", "up", "down") for s in ("weight", "weight_scale_inv")}
    assert report.tensors_loaded + len(report.not_loaded) == len(t)


def test_ep_rank_loads_whole_fp8_experts_into_local_slots(layout, tiny_checkpoint):
    ckpt = tiny_checkpoint(GLM)
    t = _tensors(ckpt)
    layout(2, 1, 1, 2)
    model, _ = _load(ckpt)
    ex = model.model.layers[3].mlp.experts
    assert ex.w13.shape[0] == 4 and ex.w13.dtype == torch.float8_e4m3fn  # EP alone never splits a block
    e = "model.layers.3.mlp.experts.6"
    assert torch.equal(ex.w13[2, 128:].view(torch.uint8), t[f"{e}.up_proj.weight"].view(torch.uint8))
    assert torch.equal(ex.w13_scale[2, 1:], t[f"{e}.up_proj.weight_scale_inv"])


def test_keeping_fp8_with_a_split_that_cuts_fp8_blocks_names_the_layer_and_tp(layout):
    layout(2, 0, 2, 1)
    model = DsaForCausalLM(load_config(GLM), with_mtp=False)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_b_proj: 2 ranks leave 96 rows of 192"):
        require_fp8_aligned(model)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts: 2 ranks leave 64 rows of 128"):
        model.model.layers[2].mlp.experts.finalize(torch.bfloat16, keep_fp8=True)


def test_layouts_that_do_not_divide_the_model_are_refused(layout):
    cfg = load_config(GLM)
    with pytest.raises(ValueError, match="--tp 3: num_attention_heads 4 is not divisible by 3"):
        validate_for_model(cfg, _state(3, 0, 3, 1))
    with pytest.raises(ValueError, match="--ep 3: n_routed_experts 8 is not divisible by 3"):
        validate_for_model(cfg, _state(3, 0, 1, 3))
    layout(3, 0, 3, 1)
    with pytest.raises(ValueError, match="--tp 3: num_attention_heads"):
        DsaForCausalLM(cfg, with_mtp=False)


def test_bad_parallel_arguments_are_named(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match="set MASTER_ADDR and MASTER_PORT or pass init_method"):
        initialize_model_parallel(tp_size=2)
    with pytest.raises(ValueError, match="tp_size: must be a positive integer"):
        initialize_model_parallel(tp_size=0)
    with pytest.raises(ValueError, match="--enable-dp-attention: needs ep_size = the world size 2"):
        initialize_model_parallel(tp_size=2, dp_attention=True)  # refused before any rendezvous
    with pytest.raises(ValueError, match="tp_size 2: must be 1 or the world size 4"):
        initialize_model_parallel(tp_size=2, ep_size=4)
    assert initialize_model_parallel(1, 1).world_size == 1  # the single-rank default needs no group
