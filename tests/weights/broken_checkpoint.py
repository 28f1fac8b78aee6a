"""Ways to break a copy of the tiny checkpoint, shared by the loader, pre-flight and CLI error tests.

Each `BREAKAGES` entry edits a checkpoint directory in place and returns a regex the one-line error must
match (the file or tensor it names).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

W = "model.layers.1.self_attn.q_b_proj.weight"
S = W + "_scale_inv"
NORM = "model.layers.0.input_layernorm.weight"
INDEX = "model.safetensors.index.json"


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def index(ckpt: Path) -> dict:
    return json.loads((ckpt / INDEX).read_text())


def write_index(ckpt: Path, idx: dict) -> None:
    (ckpt / INDEX).write_text(json.dumps(idx))


def shard_of(ckpt: Path, tensor: str) -> Path:
    return ckpt / index(ckpt)["weight_map"][tensor]


def edit_shard(ckpt: Path, tensor: str, edit: Callable[[dict], object]) -> None:
    """Rewrite the shard holding `tensor` after `edit(dict_of_tensors)`."""
    path = shard_of(ckpt, tensor)
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _missing_shard(ckpt: Path) -> str:
    path = shard_of(ckpt, W)
    path.unlink()
    return rf"{INDEX}: points at missing shard file\(s\) {path.name}"


def _truncated_shard(ckpt: Path) -> str:
    path = shard_of(ckpt, W)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path.name


def _bad_index_json(ckpt: Path) -> str:
    (ckpt / INDEX).write_text('{"weight_map": ')
    return rf"{INDEX}: not a valid safetensors index"


def _config_of_random_bytes(ckpt: Path) -> str:
    (ckpt / "config.json").write_bytes(bytes(range(128, 256)) * 3)
    return r"config.json: not valid JSON"


def _missing_tensor(ckpt: Path) -> str:
    edit_shard(ckpt, NORM, lambda t: t.pop(NORM))
    idx = index(ckpt)
    idx["weight_map"].pop(NORM)
    write_index(ckpt, idx)
    return rf"missing tensor\(s\): {NORM}"


def _wrong_shape(ckpt: Path) -> str:
    edit_shard(ckpt, NORM, lambda t: t.__setitem__(NORM, torch.ones(7, dtype=torch.bfloat16)))
    return rf"{NORM}: tensor has shape \[7\]"


BREAKAGES: dict[str, Callable[[Path], str]] = {
    "missing shard": _missing_shard, "truncated shard": _truncated_shard, "bad index json": _bad_index_json,
    "config.json of random bytes": _config_of_random_bytes, "missing tensor": _missing_tensor,
    "wrong shape": _wrong_shape,
}


def nan_scale(ckpt: Path) -> str:
    """A NaN in one weight_scale_inv: structurally perfect, so only the loader (it reads data) can see it."""
    edit_shard(ckpt, S, lambda t: t[S].view(-1).__setitem__(0, float("nan")))
    return rf"{S}: 1 non-finite value"
