"""`make-checkpoint` / write_checkpoint: the real HF FP8 layout, exactly the spec, and determinism."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dsaserve.config import load_config
from dsaserve.weights.checkpoint_writer import INDEX_FILE, plan_shards, write_checkpoint
from dsaserve.weights.fp8 import dequantize_fp8_block
from dsaserve.weights.spec import checkpoint_specs

TINY = ["glm-5.3-tiny", "deepseek-v3.2-tiny"]
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture(scope="module", params=TINY)
def ckpt(request, tmp_path_factory):
    cfg = load_config(request.param)
    return cfg, write_checkpoint(cfg, tmp_path_factory.mktemp(request.param), seed=0)


def _index(path: Path) -> dict:
    return json.loads((path / INDEX_FILE).read_text())


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(set(_index(path)["weight_map"].values())):
        with safe_open(str(path / shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118 (safe_open is not a dict)
    return out


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_index_lists_every_spec_tensor_in_at_least_two_shards_that_hold_them(ckpt):
    cfg, path = ckpt
    index = _index(path)
    specs = checkpoint_specs(cfg)
    assert set(index["weight_map"]) == {s.name for s in specs}
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert all(re.fullmatch(rf"model-0000\d-of-0000{len(shards)}\.safetensors", s) for s in shards)
    on_disk = {p.name for p in path.glob("*.safetensors")}
    assert on_disk == set(shards)
    nbytes = 0
    for shard in shards:
        with safe_open(str(path / shard), "pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == shard}
            nbytes += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys)
    assert index["metadata"]["total_size"] == nbytes == sum(s.nbytes for s in specs)


def test_every_tensor_has_the_spec_dtype_and_shape_and_fp8_weights_have_block_scales(ckpt):
    cfg, path = ckpt
    tensors = _tensors(path)
    specs = checkpoint_specs(cfg)
    for s in specs:
        t = tensors[s.name]
        assert (t.dtype, tuple(t.shape)) == (DTYPES[s.dtype], s.shape), s.name
    fp8 = [s for s in specs if s.dtype == "fp8"]
    assert len(fp8) > 50
    for s in fp8:
        scale = tensors[s.name + "_scale_inv"]
        n, k = s.shape
        assert scale.dtype == torch.float32 and tuple(scale.shape) == (math.ceil(n / 128), math.ceil(k / 128))
        assert torch.isfinite(scale).all() and (scale > 0).all()


def test_modules_to_not_convert_are_bf16_and_correction_bias_fp32(ckpt):
    cfg, path = ckpt
    tensors = _tensors(path)
    first_moe = cfg.moe_layers[0]
    bf16 = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
            "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.self_attn.q_a_layernorm.weight", "model.layers.0.self_attn.kv_a_layernorm.weight",
            f"model.layers.{first_moe}.mlp.gate.weight", "model.layers.0.self_attn.indexer.k_norm.weight",
            "model.layers.0.self_attn.indexer.k_norm.bias", "model.layers.0.self_attn.indexer.weights_proj.weight"]
    for name in bf16:
        assert tensors[name].dtype == torch.bfloat16, name
        assert name + "_scale_inv" not in tensors
    bias = tensors[f"model.layers.{first_moe}.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.shape == (cfg.n_routed_experts,)
    for name in ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.indexer.wk.weight",
                 f"model.layers.{first_moe}.mlp.experts.0.down_proj.weight"]:
        assert tensors[name].dtype == torch.float8_e4m3fn, name


def test_indexer_tensors_only_on_full_layers(ckpt):
    cfg, path = ckpt
    names = set(_index(path)["weight_map"])
    for layer in range(cfg.num_hidden_layers):
        has = {n for n in names if n.startswith(f"model.layers.{layer}.self_attn.indexer.")}
        if cfg.is_full_indexer(layer):
            assert {n.split("indexer.")[1] for n in has} == {
                "wq_b.weight", "wq_b.weight_scale_inv", "wk.weight", "wk.weight_scale_inv",
                "k_norm.weight", "k_norm.bias", "weights_proj.weight"}
        else:
            assert not has, layer
    if cfg.model_type == "glm_moe_dsa":  # the GLM tiny config really has shared layers, so this bites
        assert cfg.shared_indexer_layers


def test_per_expert_and_dense_mlp_tensors(ckpt):
    cfg, path = ckpt
    names = set(_index(path)["weight_map"])
    for layer in cfg.moe_layers:
        for j in range(cfg.n_routed_experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                assert f"model.layers.{layer}.mlp.experts.{j}.{proj}.weight" in names
        assert f"model.layers.{layer}.mlp.shared_experts.down_proj.weight" in names
    for layer in cfg.dense_layers:
        assert f"model.layers.{layer}.mlp.gate_proj.weight" in names
        assert not any(n.startswith(f"model.layers.{layer}.mlp.experts.") for n in names)


def test_mtp_layer_sits_at_index_num_hidden_layers_with_its_own_decoder_layer(ckpt):
    cfg, path = ckpt
    tensors = _tensors(path)
    m, h = f"model.layers.{cfg.num_hidden_layers}", cfg.hidden_size
    assert tensors[f"{m}.eh_proj.weight"].shape == (h, 2 * h)
    assert tensors[f"{m}.eh_proj.weight"].dtype == torch.float8_e4m3fn
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        assert tensors[f"{m}.{norm}.weight"].dtype == torch.bfloat16
    for name in ("self_attn.kv_a_proj_with_mqa.weight", "self_attn.indexer.wk.weight",
                 "mlp.experts.0.up_proj.weight", "mlp.gate.e_score_correction_bias"):
        assert f"{m}.{name}" in tensors
    assert not any(n.startswith(f"model.layers.{cfg.num_hidden_layers + 1}.") for n in tensors)


def test_a_layer_is_never_split_across_shards(ckpt):
    cfg, path = ckpt
    where: dict[str, set[str]] = {}
    for name, shard in _index(path)["weight_map"].items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m:
            where.setdefault(m.group(1), set()).add(shard)
    assert len(where) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert all(len(s) == 1 for s in where.values())


def test_initialisation_gives_unit_norms_and_logits_of_std_about_4(ckpt):
    cfg, path = ckpt
    t = _tensors(path)
    h = cfg.hidden_size
    assert t["model.embed_tokens.weight"].float().std().item() == pytest.approx(1.0, rel=0.05)
    assert t["lm_head.weight"].float().std().item() == pytest.approx(4 / math.sqrt(h), rel=0.05)
    norm = t["model.layers.0.input_layernorm.weight"].float()
    assert norm.mean().item() == pytest.approx(1.0, abs=0.02) and norm.std().item() == pytest.approx(0.05, rel=0.3)
    q = "model.layers.0.self_attn.q_a_proj"
    w = dequantize_fp8_block(t[f"{q}.weight"], t[f"{q}.weight_scale_inv"])
    assert w.std().item() == pytest.approx(1 / math.sqrt(h), rel=0.05)


def test_config_and_generation_config_describe_the_model(ckpt):
    cfg, path = ckpt
    back = load_config(path)
    assert back.to_hf_dict() == cfg.to_hf_dict()
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id[0] and gen["bos_token_id"] == cfg.bos_token_id
    assert gen["do_sample"] is False
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in path.iterdir()}


def test_same_seed_gives_byte_identical_files_and_another_seed_different_weights(ckpt, tmp_path):
    cfg, path = ckpt
    again = write_checkpoint(cfg, tmp_path / "again", seed=0)
    assert _files(again) == _files(path)
    other = _files(write_checkpoint(cfg, tmp_path / "other", seed=1))
    same = _files(path)
    shards = [n for n in same if n.endswith(".safetensors")]
    assert all(other[n] != same[n] for n in shards)
    assert all(other[n] == same[n] for n in same if n not in shards)  # config, index, tokenizer


def test_tensor_values_do_not_depend_on_the_shard_count(tmp_path):
    cfg = load_config("deepseek-v3.2-tiny")
    a = _tensors(write_checkpoint(cfg, tmp_path / "a", num_shards=2))
    b_path = write_checkpoint(cfg, tmp_path / "b", num_shards=5)
    assert len(set(_index(b_path)["weight_map"].values())) == 5
    b = _tensors(b_path)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)


def test_shard_count_errors_name_num_shards():
    cfg = load_config("glm-5.3-tiny")
    with pytest.raises(ValueError, match="num_shards.*at least 2"):
        plan_shards(cfg, 1)
    with pytest.raises(ValueError, match="num_shards: 100000"):
        plan_shards(cfg, 100000)
    # more shards than layers: layers split, but a weight stays with its scale
    for shard in plan_shards(cfg, 40):
        names = {s.name for s in shard}
        assert all(n.removesuffix("_scale_inv") in names for n in names)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dsaserve", "make-checkpoint", *args],
                          capture_output=True, text=True, timeout=300)


def test_cli_writes_a_checkpoint_and_reports_it(tmp_path):
    out = tmp_path / "ck"
    r = _cli("--config", "glm-5.3-tiny", "--out", str(out), "--seed", "3", "--num-shards", "3")
    assert r.returncode == 0, r.stderr
    index = _index(out)
    assert f"{len(index['weight_map'])} tensors" in r.stdout
    assert f"{index['metadata']['total_size']:,} bytes" in r.stdout and "3 shards" in r.stdout
    assert _files(out) == _files(write_checkpoint(load_config("glm-5.3-tiny"), tmp_path / "py", seed=3, num_shards=3))
    # a non-empty --out is refused, --force replaces the checkpoint (old shards included)
    r = _cli("--config", "glm-5.3-tiny", "--out", str(out))
    assert r.returncode == 2 and "--out" in r.stderr and "not empty" in r.stderr
    r = _cli("--config", "glm-5.3-tiny", "--out", str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert len(list(out.glob("*.safetensors"))) == 2


def test_cli_names_an_unknown_config(tmp_path):
    r = _cli("--config", "no-such-model", "--out", str(tmp_path / "x"))
    assert r.returncode == 2
    assert "--config" in r.stderr and "no-such-model" in r.stderr and "glm-5.3-tiny" in r.stderr
    assert not (tmp_path / "x").exists()
