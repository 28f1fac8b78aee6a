"""Name mapping between the trainable model (HF GlmMoeDsaForCausalLM + MTP layer) and the checkpoint.

Owns: both directions of the one mapping — `checkpoint_tensors(model)` (HF state -> the checkpoint's
per-expert names, for `write_checkpoint_from_tensors`) and `load_checkpoint_into(model, dir)` (a written
checkpoint, FP8 weights dequantised with their block scales, back into a MiniLM). The differences are
only: HF stacks experts (gate_up_proj [E, 2I, H] = gate rows then up rows, down_proj [E, H, I]); the MTP
layer is `model.layers.N.*` on disk and `mtp.*` here; HF's rotary tables are not weights.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from dsaserve.config import ModelConfig, load_config
from dsaserve.weights.checkpoint_check import read_index
from dsaserve.weights.fp8 import dequantize_fp8_block

_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def _hf_to_disk_name(cfg: ModelConfig, name: str) -> str:
    if name.startswith("mtp."):
        return f"model.layers.{cfg.num_hidden_layers}." + name.removeprefix("mtp.")
    return name.removeprefix("lm.")


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """Every checkpoint weight of a MiniLM, float32 on the CPU, under its checkpoint name."""
    cfg: ModelConfig = model.cfg
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if "rotary_emb" in name:
            continue
        name, t = _hf_to_disk_name(cfg, name), t.detach().float().cpu()
        m = _STACKED.match(name)
        if m is None:
            out[name] = t
            continue
        prefix, kind = m.groups()
        for j in range(t.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{j}.down_proj.weight"] = t[j].clone()
            else:
                gate, up = t[j].chunk(2, dim=0)
                out[f"{prefix}.{j}.gate_proj.weight"] = gate.clone()
                out[f"{prefix}.{j}.up_proj.weight"] = up.clone()
    return out


def read_checkpoint(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """All weights of a checkpoint directory in float32, FP8 ones dequantised with their block scales."""
    ckpt = Path(ckpt)
    weight_map = read_index(ckpt)
    raw: dict[str, torch.Tensor] = {}
    for fname in sorted(set(weight_map.values())):
        with safe_open(str(ckpt / fname), framework="pt") as f:
            for k in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                raw[k] = f.get_tensor(k)
    out = {}
    for k, v in raw.items():
        if k.endswith("weight_scale_inv"):
            continue
        out[k] = dequantize_fp8_block(v, raw[k + "_scale_inv"], name=k) if v.dtype == torch.float8_e4m3fn \
            else v.float()
    return out


def hf_state_from_checkpoint(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> MiniLM state-dict names (experts stacked, layer N under `mtp.`)."""
    sd: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    for k, v in tensors.items():
        name = "mtp." + k.removeprefix(mtp) if k.startswith(mtp) else "lm." + k
        e = _EXPERT.match(name)
        if e:
            experts.setdefault(e.group(1), {}).setdefault(int(e.group(2)), {})[e.group(3)] = v
        else:
            sd[name] = v
    for prefix, per in experts.items():
        ids = sorted(per)
        sd[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([per[j]["gate"], per[j]["up"]]) for j in ids])
        sd[f"{prefix}.down_proj"] = torch.stack([per[j]["down"] for j in ids])
    return sd


def load_mini(ckpt: str | Path, train_indexer: bool = False):
    """A MiniLM (float32, eval mode) holding a written checkpoint's weights; strict: every name must match."""
    from dsaserve.training.hf_model import MiniLM

    cfg = load_config(ckpt)
    torch.manual_seed(0)
    model = MiniLM(cfg, train_indexer=train_indexer)
    missing, unexpected = model.load_state_dict(hf_state_from_checkpoint(cfg, read_checkpoint(ckpt)), strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model.float().eval()
