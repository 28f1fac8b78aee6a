"""`write_checkpoint_from_tensors`: given weights go to disk in the random writer's exact layout."""

from __future__ import annotations

import json

import pytest
import torch

from dsaserve.config import load_config
from dsaserve.training.export import read_checkpoint
from dsaserve.weights.checkpoint_writer import random_tensor, write_checkpoint, write_checkpoint_from_tensors
from dsaserve.weights.fp8 import dequantize_fp8_block, quantize_fp8_block
from dsaserve.weights.spec import checkpoint_specs

CFG = "glm-5.3-tiny"


def _weights(cfg, seed: int) -> dict[str, torch.Tensor]:
    return {s.name: random_tensor(cfg, s, seed) for s in checkpoint_specs(cfg) if not s.name.endswith("_scale_inv")}


def test_same_files_as_the_random_writer(tmp_path):
    """Given the random writer's own values, the shards are byte-identical (same plan, same quantisation)."""
    cfg = load_config(CFG)
    a, b = tmp_path / "random", tmp_path / "given"
    write_checkpoint(cfg, a, seed=3)
    write_checkpoint_from_tensors(cfg, b, _weights(cfg, 3))
    index = json.loads((a / "model.safetensors.index.json").read_text())
    assert index == json.loads((b / "model.safetensors.index.json").read_text())
    for shard in set(index["weight_map"].values()):
        assert (a / shard).read_bytes() == (b / shard).read_bytes(), shard
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


def test_values_round_trip_through_fp8_and_bf16(tmp_path):
    cfg = load_config(CFG)
    given = _weights(cfg, 5)
    write_checkpoint_from_tensors(cfg, tmp_path, given)
    back = read_checkpoint(tmp_path)
    assert set(back) == set(given)
    dtypes = {s.name: s.dtype for s in checkpoint_specs(cfg)}
    for name, w in given.items():
        if dtypes[name] == "fp8":
            want = dequantize_fp8_block(*quantize_fp8_block(w))
        else:
            want = w.to(torch.bfloat16 if dtypes[name] == "bf16" else torch.float32).float()
        assert torch.equal(back[name], want), name


def test_missing_extra_or_misshapen_tensors_are_named(tmp_path):
    cfg = load_config(CFG)
    given = _weights(cfg, 0)
    name = "model.layers.0.self_attn.q_a_proj.weight"
    with pytest.raises(ValueError, match="missing.*q_a_proj"):
        write_checkpoint_from_tensors(cfg, tmp_path, {k: v for k, v in given.items() if k != name})
    with pytest.raises(ValueError, match="unexpected.*extra"):
        write_checkpoint_from_tensors(cfg, tmp_path, {**given, "extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError, match="q_a_proj.weight has shape"):
        write_checkpoint_from_tensors(cfg, tmp_path, {**given, name: torch.zeros(3, 3)})
