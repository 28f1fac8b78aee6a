"""ModelConfig parsing: built-in configs' structure, the three ways to say indexer types, and errors
that name the field."""

from __future__ import annotations

import json

import pytest

from dsaserve.config import ConfigError, builtin_config_names, config_from_dict, load_config


def _raw(name: str = "glm-5.3-tiny") -> dict:
    return json.loads(load_config(name).to_json())


def test_glm53_has_21_full_and_57_shared_indexer_layers_and_one_mtp_layer():
    cfg = load_config("glm-5.3")
    assert (cfg.num_hidden_layers, len(cfg.full_indexer_layers), len(cfg.shared_indexer_layers)) == (78, 21, 57)
    assert cfg.full_indexer_layers[:3] == (0, 1, 5) and cfg.mtp_layer_ids == (78,)
    assert cfg.dense_layers == (0, 1, 2) and cfg.kv_latent_dim == 576
    assert cfg.quantization is not None and cfg.quantization.weight_block_size == (128, 128)


def test_deepseek_v32_has_every_layer_full():
    cfg = load_config("deepseek-v3.2")
    assert len(cfg.full_indexer_layers) == 61 and not cfg.shared_indexer_layers
    assert cfg.rope_parameters["rope_type"] == "yarn"


@pytest.mark.parametrize("name", ["glm-5.3-tiny", "deepseek-v3.2-tiny"])
def test_tiny_configs_keep_the_structure_that_matters(name):
    cfg = load_config(name)
    assert cfg.dense_layers and cfg.moe_layers and cfg.num_nextn_predict_layers == 1
    assert cfg.index_topk <= 16 and cfg.hidden_size <= 256
    if name.startswith("glm"):
        assert cfg.full_indexer_layers and cfg.shared_indexer_layers


def test_every_builtin_round_trips_through_its_hf_json():
    for name in builtin_config_names():
        cfg = load_config(name)
        again = config_from_dict(json.loads(cfg.to_json()), name=name)
        assert again == cfg


def test_indexer_types_from_pattern_string_and_explicit_list():
    raw = _raw()
    raw.pop("indexer_types")
    raw["index_topk_pattern"] = "FFSSSF"
    assert config_from_dict(raw).indexer_types == ("full", "full", "shared", "shared", "shared", "full")
    raw.pop("index_topk_pattern")
    raw["indexer_types"] = ["full"] * 6
    assert not config_from_dict(raw).shared_indexer_layers


@pytest.mark.parametrize(("edit", "field"), [
    (lambda r: r.pop("hidden_size"), "hidden_size"),
    (lambda r: r.update(model_type="llama"), "model_type"),
    (lambda r: r.update(num_attention_heads="four"), "num_attention_heads"),
    (lambda r: r.update(index_topk=-1), "index_topk"),
    (lambda r: r.update(n_group=3), "n_group"),
    (lambda r: r.update(indexer_types=["full"] * 5), "indexer_types"),
    (lambda r: r.update(indexer_types=["shared"] + ["full"] * 5), "indexer_types"),
    (lambda r: (r.pop("indexer_types"), r.update(index_topk_pattern="FFXSSF")), "index_topk_pattern"),
    (lambda r: r.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1.0}), "rope_parameters.rope_type"),
    (lambda r: r.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1.0}), "rope_parameters.factor"),
    (lambda r: r["quantization_config"].update(weight_block_size=[64, 64]), "quantization_config.weight_block_size"),
    (lambda r: r["quantization_config"].update(quant_method="awq"), "quantization_config.quant_method"),
    (lambda r: r.update(moe_intermediate_size=96), "moe_intermediate_size"),
])
def test_bad_or_missing_field_is_named(edit, field):
    raw = _raw()
    edit(raw)
    with pytest.raises(ConfigError, match=f"^{field}"):
        config_from_dict(raw)


def test_unknown_model_name_lists_the_builtins(tmp_path):
    with pytest.raises(ConfigError, match="glm-5.3-tiny"):
        load_config("no-such-model")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


@pytest.mark.parametrize("content", [bytes(range(128, 256)), b"[1, 2]", None])
def test_an_unparsable_config_json_names_the_file_in_one_line(tmp_path, content):
    raw = _raw()
    raw["rope_parameters"] = 5  # valid JSON, wrong type: used when content is None
    (tmp_path / "config.json").write_bytes(content if content is not None else json.dumps(raw).encode())
    with pytest.raises(ConfigError, match=f"^{tmp_path}/config.json: ") as e:
        load_config(tmp_path)
    assert "\n" not in str(e.value)


def test_a_bad_field_read_from_a_file_names_the_file_and_the_field(tmp_path):
    raw = _raw()
    raw["index_topk"] = -1
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"^{tmp_path}/config.json: index_topk"):
        load_config(tmp_path)


def test_a_config_file_is_named_by_its_stem_or_its_checkpoint_directory(tmp_path, monkeypatch):
    text = load_config("glm-5.3-tiny").to_json()
    (tmp_path / "my-model.json").write_text(text)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(text)
    assert load_config(tmp_path / "my-model.json").name == "my-model"  # not the folder it sits in
    assert load_config(tmp_path / "ckpt").name == load_config(tmp_path / "ckpt" / "config.json").name == "ckpt"
    monkeypatch.chdir(tmp_path / "ckpt")
    assert load_config("config.json").name == "ckpt"  # the working directory, not ""
    assert load_config("glm-5.3-tiny").name == "glm-5.3-tiny"
