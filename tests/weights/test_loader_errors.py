"""Every way a checkpoint can be wrong fails at load time with a message naming the culprit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsaserve.config import load_config
from dsaserve.model.glm_moe_dsa import DsaForCausalLM
from dsaserve.weights.loader import CheckpointError, load_checkpoint
from tests.weights.broken_checkpoint import BREAKAGES, S, W, copy_checkpoint, nan_scale
from tests.weights.broken_checkpoint import edit_shard as _edit_shard
from tests.weights.broken_checkpoint import index as _index
from tests.weights.broken_checkpoint import write_index as _write_index


@pytest.fixture()
def ckpt(tmp_path, tiny_checkpoint) -> Path:
    return copy_checkpoint(tiny_checkpoint("glm-5.3-tiny"), tmp_path / "ckpt")


def _load(ckpt: Path):
    return load_checkpoint(DsaForCausalLM(load_config(ckpt), with_mtp=True), ckpt, progress=False)


def test_clean_checkpoint_loads_every_tensor(ckpt):
    report = _load(ckpt)
    assert report.tensors_loaded == len(_index(ckpt)["weight_map"]) and not report.not_loaded


def test_missing_tensor_is_named(ckpt):
    name = "model.layers.2.post_attention_layernorm.weight"
    _edit_shard(ckpt, name, lambda t: t.pop(name))
    index = _index(ckpt)
    index["weight_map"].pop(name)
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=name):
        _load(ckpt)


def test_fp8_weight_without_scale_is_named(ckpt):
    _edit_shard(ckpt, S, lambda t: t.pop(S))
    index = _index(ckpt)
    index["weight_map"].pop(S)
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=rf"{W}: FP8 weight without its scale"):
        _load(ckpt)


def test_scale_of_wrong_shape_is_named(ckpt):
    _edit_shard(ckpt, S, lambda t: t.__setitem__(S, torch.ones(3, 3)))
    with pytest.raises(CheckpointError, match=rf"{S}: scale has shape \[3, 3\]"):
        _load(ckpt)


def test_weight_shape_mismatch_is_named(ckpt):
    name = "model.layers.0.input_layernorm.weight"
    _edit_shard(ckpt, name, lambda t: t.__setitem__(name, torch.ones(7, dtype=torch.bfloat16)))
    with pytest.raises(CheckpointError, match=rf"{name}: tensor has shape \[7\]"):
        _load(ckpt)


def test_wrong_storage_dtype_is_named(ckpt):
    _edit_shard(ckpt, W, lambda t: t.__setitem__(W, t[W].to(torch.bfloat16)))
    with pytest.raises(CheckpointError, match=rf"{W}: stored as torch.bfloat16"):
        _load(ckpt)


def test_tensor_not_in_its_shard_is_named(ckpt):
    index = _index(ckpt)
    shards = sorted(set(index["weight_map"].values()))
    other = next(s for s in shards if s != index["weight_map"][W])
    index["weight_map"][W] = other
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=rf"{W}: the index places it in {other}"):
        _load(ckpt)


def test_index_pointing_at_missing_file_is_named(ckpt):
    index = _index(ckpt)
    index["weight_map"][W] = "model-99999-of-99999.safetensors"
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError, match="missing shard file.*model-99999-of-99999"):
        _load(ckpt)


def test_truncated_shard_is_named(ckpt):
    shard = ckpt / _index(ckpt)["weight_map"][W]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=shard.name):
        _load(ckpt)


def test_corrupt_shard_header_is_named(ckpt):
    shard = ckpt / _index(ckpt)["weight_map"][W]
    data = bytearray(shard.read_bytes())
    data[8:40] = b"\xff" * 32  # garbage in the JSON header
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        _load(ckpt)


def test_unconsumed_tensor_fails_coverage_check(ckpt):
    extra = "model.layers.0.self_attn.mystery_proj.weight"
    _edit_shard(ckpt, W, lambda t: t.__setitem__(extra, torch.zeros(4, dtype=torch.bfloat16)))
    index = _index(ckpt)
    index["weight_map"][extra] = index["weight_map"][W]
    _write_index(ckpt, index)
    with pytest.raises(CheckpointError, match=f"neither used by the model nor on the not-loaded list: {extra}"):
        _load(ckpt)


def test_mtp_tensors_are_listed_as_not_loaded_when_mtp_is_off(ckpt):
    report = load_checkpoint(DsaForCausalLM(load_config(ckpt), with_mtp=False), ckpt, progress=False)
    assert report.not_loaded and all(k.startswith("model.layers.6.") for k in report.not_loaded)
    assert report.tensors_loaded + len(report.not_loaded) == len(_index(ckpt)["weight_map"])


def test_tied_word_embeddings_fill_lm_head_from_the_embedding(tmp_path):
    import dataclasses

    from dsaserve.weights.checkpoint_writer import write_checkpoint

    cfg = dataclasses.replace(load_config("glm-5.3-tiny"), tie_word_embeddings=True)
    ckpt = write_checkpoint(cfg, tmp_path / "tied")
    model = DsaForCausalLM(load_config(ckpt), with_mtp=False)
    load_checkpoint(model, ckpt, progress=False)  # no lm_head.weight on disk, yet nothing left unfilled
    model.finalize(torch.float32, torch.device("cpu"), keep_fp8=False)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_a_parameter_no_tensor_fills_is_named(ckpt):
    model = DsaForCausalLM(load_config(ckpt), with_mtp=True)
    model.extra = torch.nn.Parameter(torch.empty(3), requires_grad=False)  # the model grew, the spec did not
    with pytest.raises(CheckpointError, match="no checkpoint tensor filled: extra"):
        load_checkpoint(model, ckpt, progress=False)


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_every_broken_checkpoint_is_one_checkpoint_error_naming_the_culprit(ckpt, breakage):
    pattern = BREAKAGES[breakage](ckpt)
    with pytest.raises(CheckpointError, match=pattern) as e:
        _load(ckpt) if breakage != "config.json of random bytes" else load_config(ckpt)
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)


def test_nan_weight_scale_inv_is_refused_by_name(ckpt):
    with pytest.raises(CheckpointError, match=nan_scale(ckpt)):
        _load(ckpt)


def test_inf_in_a_bf16_norm_is_refused_by_name(ckpt):
    name = "model.layers.2.post_attention_layernorm.weight"
    _edit_shard(ckpt, name, lambda t: t[name].__setitem__(3, float("inf")))
    with pytest.raises(CheckpointError, match=rf"{name}: 1 non-finite value"):
        _load(ckpt)


def test_nan_encoding_in_an_fp8_weight_is_refused_by_name(ckpt):
    def poke(t):  # e4m3fn has two NaN bytes, 0x7f and 0xff, and no Inf
        t[W].view(torch.uint8).view(-1)[:2] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8)

    _edit_shard(ckpt, W, poke)
    with pytest.raises(CheckpointError, match=rf"{W}: 2 non-finite value"):
        _load(ckpt)


def test_a_finite_fp8_extreme_is_not_mistaken_for_nan(ckpt):
    _edit_shard(ckpt, W, lambda t: t[W].view(torch.uint8).view(-1).__setitem__(0, 0x7E))  # 448, e4m3fn's max
    _load(ckpt)
