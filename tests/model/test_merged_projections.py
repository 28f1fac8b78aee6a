"""The GPU path's load-time rewrites, checked on the CPU with the reference kernels.

On a GPU `finalize(keep_fp8=True)` keeps FP8 weights and merges projections of one input into one GEMM
(q_a + kv_a + indexer wk, gate + up), and may fold the indexer's scales into `weights_proj`; the RoPE
tables are gathered instead of computed. The reference kernels run FP8 weights too (dequantised on the
fly), so the same rewrites can be run here: the logits must not move at all.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.config import load_config
from dsaserve.engine.kv_pool import KVPool
from dsaserve.model.forward_batch import contiguous_batch
from dsaserve.model.glm_moe_dsa import DsaForCausalLM
from dsaserve.model.layers.indexer import Indexer
from dsaserve.model.layers.linear import Linear, MergedLinear
from dsaserve.model.layers.moe import MoE
from dsaserve.model.layers.rope import RotaryTables
from dsaserve.weights.loader import load_checkpoint


def _logits(ckpt, keep_fp8: bool) -> tuple[torch.Tensor, DsaForCausalLM]:
    cfg = load_config(ckpt)
    model = DsaForCausalLM(cfg, with_mtp=False)
    load_checkpoint(model, ckpt, progress=False)
    model.finalize(torch.float32, torch.device("cpu"), keep_fp8)
    pool = KVPool(cfg, 8, "fp32", model.kv_layer_ids, 64, torch.float32, "cpu")
    batch = contiguous_batch([list(range(3, 70)), list(range(100, 120))], [0, 0], [0, 256], 64)
    return model(batch, pool)[0], model


@pytest.mark.parametrize("name", ["glm-5.3-tiny", "deepseek-v3.2-tiny"])
def test_merged_projections_leave_the_logits_unchanged(tiny_checkpoint, name):
    ckpt = tiny_checkpoint(name)
    plain, _ = _logits(ckpt, keep_fp8=False)
    merged_logits, model = _logits(ckpt, keep_fp8=True)
    merged = [m for m in model.modules() if isinstance(m, MergedLinear)]
    cfg = model.cfg
    assert len(merged) == cfg.num_hidden_layers + sum(not cfg.is_moe(i) or cfg.n_shared_experts > 0
                                                      for i in range(cfg.num_hidden_layers))
    attn = model.model.layers[0].self_attn
    assert attn.q_a_proj is None and attn.qkv_a is not None  # the parts' weights are gone
    torch.testing.assert_close(merged_logits, plain, rtol=0, atol=0)
    for mlp in (layer.mlp for layer in model.model.layers
                if isinstance(layer.mlp, MoE) and layer.mlp.shared_experts is not None):
        # the shared expert rides fused_moe (`shared=`): laid out as one routed expert, as its GPU kernel reads it
        shared, ex = mlp.shared_experts.expert_form, mlp.experts
        assert shared is not None and all(a.shape == b.shape[1:] and a.stride() == b.stride()[1:] for a, b in
                                          zip(shared[:4], (ex.w13, ex.w13_scale, ex.w2, ex.w2_scale), strict=True))


def test_a_merged_linear_pads_each_part_to_whole_scale_blocks():
    parts = []
    for n in (256, 576, 128):
        lin = Linear(256, n, quantized=True)
        lin.weight.data = torch.randn(n, 256).to(torch.float8_e4m3fn)
        lin.weight_scale_inv.data = torch.rand(lin.weight_scale_inv.shape) + 0.5
        lin.finalize(torch.float32, keep_fp8=True)
        parts.append(lin)
    merged = MergedLinear(parts)
    assert merged.slices == [(0, 256), (256, 832), (896, 1024)]  # 576 rows padded to 640
    assert merged.weight_scale_inv.shape == (8, 2) and merged.disk_bytes == sum(p.disk_bytes for p in parts)
    x = torch.randn(3, 256)
    for got, part in zip(merged(x), parts, strict=True):
        torch.testing.assert_close(got, part(x), rtol=0, atol=0)


def test_rope_table_rows_equal_the_per_step_formula():
    cfg = load_config("deepseek-v3.2-tiny")  # YaRN: attention factor and ramped frequencies
    rot = RotaryTables(cfg)
    pos = torch.tensor([0, 1, 77, 4095, cfg.max_position_embeddings - 1])
    table_cos, table_sin = rot.table_rows(pos, torch.bfloat16)  # what the GPU path gathers
    cos, sin = rot(pos, torch.bfloat16)  # what the CPU path computes
    assert torch.equal(table_cos, cos) and torch.equal(table_sin, sin)
    # one gather, two views: the kernels take them with a unit last stride and (rope_inplace) equal strides
    assert table_cos.stride() == table_sin.stride() and table_cos.stride(-1) == 1


@pytest.mark.parametrize("heads,dim,folds", [(32, 128, True), (16, 32, False)])
def test_indexer_scales_fold_into_weights_proj_only_when_exact(heads, dim, folds):
    cfg = dataclasses.replace(load_config("glm-5.3-tiny"), index_n_heads=heads, index_head_dim=dim)
    idx = Indexer(cfg, "model.layers.0.self_attn.indexer")
    idx.weights_proj.weight.data = torch.randn(heads, cfg.hidden_size).bfloat16()
    idx.weights_proj.finalize(torch.bfloat16, keep_fp8=True)
    x = torch.randn(4, cfg.hidden_size).bfloat16()
    before = idx.head_weights(x)
    idx.finalize_scale()
    assert (idx.scale_folded != 1.0) == folds
    torch.testing.assert_close(idx.head_weights(x).float(), before, rtol=0, atol=0)
