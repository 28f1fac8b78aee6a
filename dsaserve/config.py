"""ModelConfig: the one parsed form of a `glm_moe_dsa` / `deepseek_v32` config.json.

Owns: reading a Hugging Face config.json (or a built-in name) into a frozen dataclass, deriving the
per-layer structure (dense vs MoE MLP, "full" vs "shared" indexer layers, the MTP layer index), and
writing it back out in the HF layout. Every other part of dsaserve (loader, model, engine, ledger)
takes its dimensions from here, so a field's meaning is fixed in one place. Pure Python: no torch.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from dsaserve.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")
FP8_BLOCK = 128  # DeepSeek/GLM FP8 checkpoints quantise weights in 128x128 blocks


class ConfigError(CheckpointError):
    """A config.json is unreadable, or a field is missing or has a bad value; the message names the file/field."""


@dataclass(frozen=True)
class QuantConfig:
    """`quantization_config` of an FP8 checkpoint (`quant_method: fp8`, block-wise e4m3)."""

    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()

    def to_hf(self) -> dict[str, Any]:
        return {
            "quant_method": "fp8",
            "fmt": self.fmt,
            "activation_scheme": self.activation_scheme,
            "weight_block_size": list(self.weight_block_size),
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions and per-layer structure of a DSA-MoE model, as in its config.json."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    mlp_layer_types: tuple[str, ...] = ()
    indexer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 0
    eos_token_id: tuple[int, ...] = (1,)
    pad_token_id: int | None = None
    quantization: QuantConfig | None = None
    name: str = ""

    # ---- derived structure -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Width of the cached MLA latent: kv_lora_rank nope + qk_rope_head_dim rope (512+64=576)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def full_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    @property
    def shared_indexer_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "shared")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "sparse")

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "dense")

    @property
    def mtp_layer_ids(self) -> tuple[int, ...]:
        """MTP layers live after the main stack: layer index N, N+1, ... in the checkpoint."""
        n = self.num_hidden_layers
        return tuple(range(n, n + self.num_nextn_predict_layers))

    def is_full_indexer(self, layer: int) -> bool:
        """MTP layers (index >= num_hidden_layers) always run their own indexer."""
        return layer >= self.num_hidden_layers or self.indexer_types[layer] == "full"

    def is_moe(self, layer: int) -> bool:
        """MTP layers are MoE layers in GLM-5 and DeepSeek-V3."""
        return layer >= self.num_hidden_layers or self.mlp_layer_types[layer] == "sparse"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.eos_token_id

    # ---- serialisation -----------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json a real checkpoint of this model would carry."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("quantization", "name")}
        d["architectures"] = [ARCHITECTURES[self.model_type]]
        d["num_key_value_heads"] = self.num_attention_heads
        d["mlp_layer_types"] = list(self.mlp_layer_types)
        d["indexer_types"] = list(self.indexer_types)
        d["eos_token_id"] = list(self.eos_token_id) if len(self.eos_token_id) > 1 else self.eos_token_id[0]
        d["rope_parameters"] = dict(self.rope_parameters)
        d["torch_dtype"] = "bfloat16"
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_hf()
        if self.model_type == "deepseek_v32":  # DeepSeek-V3.2 has every layer full: no indexer_types key
            d.pop("indexer_types")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True)

    def summary(self) -> dict[str, Any]:
        return asdict(self)


ARCHITECTURES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}

# Fields a config.json must carry (no safe default exists for them).
_REQUIRED = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
    "v_head_dim", "n_routed_experts", "num_experts_per_tok",
)
# Fields with the defaults HF's GlmMoeDsaConfig / DeepseekV32Config use.
_DEFAULTS: dict[str, Any] = {
    "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True, "first_k_dense_replace": 3, "index_topk": 2048, "index_n_heads": 32,
    "index_head_dim": 128, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 0, "pad_token_id": None,
}
_INT_FIELDS = {f for f in _REQUIRED} | {
    "n_shared_experts", "n_group", "topk_group", "first_k_dense_replace", "index_topk", "index_n_heads",
    "index_head_dim", "num_nextn_predict_layers", "max_position_embeddings",
}


def _indexer_types(raw: dict[str, Any], model_type: str, n_layers: int) -> tuple[str, ...]:
    """Explicit list > pattern string ("FSSF...") > index_topk_freq / index_skip_topk_offset."""
    if model_type == "deepseek_v32" and "indexer_types" not in raw and "index_topk_pattern" not in raw:
        return ("full",) * n_layers
    if raw.get("indexer_types") is not None:
        types = tuple(raw["indexer_types"])
    elif raw.get("index_topk_pattern") is not None:
        pat = raw["index_topk_pattern"]
        try:
            types = tuple({"F": "full", "S": "shared"}[c] for c in pat) if isinstance(pat, str) else tuple(pat)
        except KeyError as e:
            raise ConfigError(f"index_topk_pattern: unknown letter {e.args[0]!r} (use F or S)") from None
    else:
        freq = max(int(raw.get("index_topk_freq", 1)), 1)
        offset = int(raw.get("index_skip_topk_offset", 2))
        # Same rule as HF GlmMoeDsaConfig: GLM-5.3 (freq 4, offset 2) gives 21 full + 57 shared of 78.
        types = tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers))
    if len(types) != n_layers:
        raise ConfigError(f"indexer_types: has {len(types)} entries, num_hidden_layers is {n_layers}")
    bad = [t for t in types if t not in ("full", "shared")]
    if bad:
        raise ConfigError(f"indexer_types: unknown type {bad[0]!r} (use 'full' or 'shared')")
    if types and types[0] != "full":
        raise ConfigError("indexer_types: layer 0 must be 'full' (a shared layer reuses an earlier full layer)")
    return types


def _mlp_layer_types(raw: dict[str, Any], n_layers: int, k_dense: int) -> tuple[str, ...]:
    if raw.get("mlp_layer_types") is not None:
        types = tuple(raw["mlp_layer_types"])
        if len(types) != n_layers or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError("mlp_layer_types: need one 'dense'/'sparse' entry per layer")
        return types
    n_dense = min(k_dense, n_layers)
    return ("dense",) * n_dense + ("sparse",) * (n_layers - n_dense)


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    rp = raw.get("rope_parameters") or raw.get("rope_scaling")
    rp = dict(rp) if rp else {}
    if "type" in rp and "rope_type" not in rp:
        rp["rope_type"] = rp.pop("type")
    rp.setdefault("rope_type", "default")
    rp.setdefault("rope_theta", float(raw.get("rope_theta", 10000.0)))
    if rp["rope_type"] not in ("default", "yarn"):
        raise ConfigError(f"rope_parameters.rope_type: {rp['rope_type']!r} not supported (default, yarn)")
    if rp["rope_type"] == "yarn":
        for k in ("factor", "original_max_position_embeddings"):
            if k not in rp:
                raise ConfigError(f"rope_parameters.{k}: required for yarn RoPE")
    return rp


def _quant(raw: dict[str, Any]) -> QuantConfig | None:
    q = raw.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ConfigError(f"quantization_config.quant_method: {q.get('quant_method')!r} not supported (fp8)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt: {fmt!r} not supported (e4m3)")
    block = tuple(q.get("weight_block_size") or (FP8_BLOCK, FP8_BLOCK))
    if block != (FP8_BLOCK, FP8_BLOCK):
        raise ConfigError(f"quantization_config.weight_block_size: {list(block)} not supported ([128, 128])")
    return QuantConfig(fmt=fmt, weight_block_size=block, activation_scheme=q.get("activation_scheme", "dynamic"),
                       modules_to_not_convert=tuple(q.get("modules_to_not_convert") or ()))


def config_from_dict(raw: dict[str, Any], name: str = "") -> ModelConfig:
    """Parse a config.json dict; every error names the offending field."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type: {model_type!r} not supported (one of {', '.join(SUPPORTED_MODEL_TYPES)})")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        also = f" (also {', '.join(missing[1:])})" if missing[1:] else ""
        raise ConfigError(f"{missing[0]}: missing from config.json{also}")
    vals: dict[str, Any] = {}
    for k in _REQUIRED + tuple(_DEFAULTS):
        v = raw.get(k, _DEFAULTS.get(k))
        if k in _INT_FIELDS and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ConfigError(f"{k}: expected a non-negative integer, got {v!r}")
        vals[k] = v
    if "rms_norm_eps" not in raw and model_type == "glm_moe_dsa":
        vals["rms_norm_eps"] = 1e-5
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "n_routed_experts"):
        if vals[k] <= 0:
            raise ConfigError(f"{k}: must be positive, got {vals[k]}")
    if vals["n_routed_experts"] % vals["n_group"]:
        raise ConfigError(f"n_group: {vals['n_group']} does not divide n_routed_experts {vals['n_routed_experts']}")
    if vals["num_experts_per_tok"] > vals["n_routed_experts"]:
        raise ConfigError("num_experts_per_tok: larger than n_routed_experts")
    if vals["topk_group"] > vals["n_group"]:
        raise ConfigError("topk_group: larger than n_group")
    if vals["qk_rope_head_dim"] % 2 or vals["qk_rope_head_dim"] > vals["index_head_dim"]:
        raise ConfigError("qk_rope_head_dim: must be even and no wider than index_head_dim")
    if raw.get("quantization_config") and vals["moe_intermediate_size"] % FP8_BLOCK:
        # gate and up experts are fused as one [2I, H] FP8 GEMM; their 128-row scale blocks must not straddle
        raise ConfigError(f"moe_intermediate_size: {vals['moe_intermediate_size']} must be a multiple of "
                          f"{FP8_BLOCK} for an FP8 checkpoint")
    eos = raw.get("eos_token_id", 1)
    eos = tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    n = vals["num_hidden_layers"]
    return ModelConfig(
        model_type=model_type,
        rope_parameters=_rope_parameters(raw),
        mlp_layer_types=_mlp_layer_types(raw, n, vals["first_k_dense_replace"]),
        indexer_types=_indexer_types(raw, model_type, n),
        eos_token_id=eos,
        quantization=_quant(raw),
        name=name,
        **vals,
    )


def is_not_converted(cfg: ModelConfig, module: str) -> bool:
    """True if `module` (a dotted path) matches a `modules_to_not_convert` entry at a component boundary.

    Matching on components (not substrings) keeps `mlp.gate` from also catching `mlp.gate_proj`.
    """
    if cfg.quantization is None:
        return True
    padded = "." + module
    return any(padded.endswith("." + m) or ("." + m + ".") in padded + "."
               for m in cfg.quantization.modules_to_not_convert)


def builtin_config_names() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("dsaserve.configs").iterdir() if p.name.endswith(".json"))


def read_json_object(p: Path) -> dict[str, Any]:
    """A config.json (or tokenizer_config.json) as a dict; bad bytes, bad JSON or a non-object name the file."""
    try:
        raw = json.loads(p.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read it ({e.strerror})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _file_model_name(p: Path) -> str:
    """`my-model.json` names itself; a `config.json` is named by its (checkpoint) directory, absolute so that
    `config.json` in the working directory is not nameless (not resolved: an HF snapshot's files are links)."""
    return p.absolute().parent.name if p.name == "config.json" else p.stem


def load_config(name_or_path: str | Path) -> ModelConfig:
    """A built-in name (`glm-5.3`, `glm-5.3-tiny`, ...), a config.json path, or a checkpoint directory."""
    p = Path(name_or_path)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        try:
            return config_from_dict(read_json_object(p), name=_file_model_name(p))
        except ConfigError as e:
            raise ConfigError(str(e) if str(e).startswith(str(p)) else f"{p}: {e}") from None
        except (TypeError, AttributeError, KeyError) as e:  # a field of the wrong JSON type (a map for a list...)
            raise ConfigError(f"{p}: malformed config ({type(e).__name__}: {e})") from None
    name = str(name_or_path)
    res = resources.files("dsaserve.configs") / f"{name}.json"
    if not res.is_file():
        raise ConfigError(f"model: {name!r} is neither a config.json/checkpoint directory nor a built-in config "
                          f"({', '.join(builtin_config_names())})")
    return config_from_dict(json.loads(res.read_text()), name=name)
