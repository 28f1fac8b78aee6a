"""The numerics oracle: HF transformers' GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM on the same weights.

Builds the HF model from a dsaserve checkpoint directory by dequantising every FP8 weight with its block
scales and stacking per-expert tensors the way HF stores experts (gate_up_proj [E, 2I, H], down_proj
[E, H, I]). HF ignores the MTP layer, so its tensors are dropped here. Used by tests only.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

import torch
from safetensors import safe_open

from dsaserve.kernels.reference import dequant_fp8_weight

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _dequantised_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    raw: dict[str, torch.Tensor] = {}
    for fname in sorted(set(weight_map.values())):
        with safe_open(str(ckpt / fname), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118
                raw[k] = f.get_tensor(k)
    out = {}
    for k, v in raw.items():
        if k.endswith("weight_scale_inv"):
            continue
        if v.dtype == torch.float8_e4m3fn:
            v = dequant_fp8_weight(v, raw[k + "_scale_inv"])
        out[k] = v.float()
    return out


def hf_state_dict(ckpt: Path, num_layers: int) -> dict[str, torch.Tensor]:
    tensors = _dequantised_tensors(ckpt)
    sd: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.", k)
        if m and int(m.group(1)) >= num_layers:
            continue  # MTP layer: transformers ignores it
        e = _EXPERT.match(k)
        if e:
            experts.setdefault(e.group(1), {}).setdefault(int(e.group(2)), {})[e.group(3)] = v
        else:
            sd[k] = v
    for prefix, per in experts.items():
        ids = sorted(per)
        sd[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([per[j]["gate"], per[j]["up"]]) for j in ids])
        sd[f"{prefix}.down_proj"] = torch.stack([per[j]["down"] for j in ids])
    return sd


@lru_cache(maxsize=4)
def hf_model(ckpt: str):
    """HF model in float32, eager attention, with the checkpoint's dequantised weights."""
    import transformers

    raw = json.loads((Path(ckpt) / "config.json").read_text())
    raw.pop("quantization_config", None)
    cls_cfg = {"glm_moe_dsa": transformers.GlmMoeDsaConfig, "deepseek_v32": transformers.DeepseekV32Config}
    cls_model = {"glm_moe_dsa": transformers.GlmMoeDsaForCausalLM, "deepseek_v32": transformers.DeepseekV32ForCausalLM}
    config = cls_cfg[raw["model_type"]](**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls_model[raw["model_type"]](config).float().eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(Path(ckpt), config.num_hidden_layers), strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    assert not missing and not unexpected, (missing[:5], unexpected[:5])
    return model


@torch.no_grad()
def hf_greedy_logits(ckpt: str | Path, prompt_ids: list[int], n_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation with a KV cache: (generated ids, logits of prefill's last token and each decode step)."""
    from transformers import DynamicCache

    model = hf_model(str(ckpt))
    cache = DynamicCache(config=model.config)
    out = model(torch.tensor([prompt_ids]), past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1].float()]
    ids: list[int] = []
    for _ in range(n_tokens):
        ids.append(int(logits[-1].argmax()))
        out = model(torch.tensor([[ids[-1]]]), past_key_values=cache, use_cache=True)
        logits.append(out.logits[0, -1].float())
    return ids, logits[:n_tokens]


def hf_greedy(ckpt: str | Path, prompt_ids: list[int], n_tokens: int) -> list[int]:
    return hf_greedy_logits(ckpt, prompt_ids, n_tokens)[0]
