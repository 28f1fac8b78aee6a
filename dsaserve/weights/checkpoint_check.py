"""The checkpoint's structure, checked without reading a tensor (startup chain: between "resolve --model"
and "load weights"; torch-free, so `dsaserve serve`'s HTTP process runs it before spawning any child).

Owns: reading `model.safetensors.index.json` (or a lone `model.safetensors`), reading a shard's
safetensors header (its tensor table; a truncated or corrupt file is caught here by comparing the header's
data offsets with the file size), the coverage rule shared with the loader (every index entry is in the
spec or in a layer deliberately skipped, every spec tensor is in the index), and `check_checkpoint`:
config.json + index + every shard header + each tensor's shape and FP8-ness against the spec. Every
failure is a `CheckpointError` whose one-line message names the file or tensor. What needs the tensor data
(non-finite values) is the loader's job.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from dsaserve.config import ModelConfig, load_config
from dsaserve.errors import CheckpointError
from dsaserve.weights.spec import checkpoint_specs

INDEX_FILE = "model.safetensors.index.json"  # HF's shard index name (checkpoint_writer writes it)
SINGLE_FILE = "model.safetensors"  # an unsharded checkpoint
FP8_DTYPE = "F8_E4M3"  # safetensors' name for float8_e4m3fn
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a safetensors header: its dtype name (`BF16`, `F32`, `F8_E4M3`, ...) and shape."""

    dtype: str
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, HeaderEntry]:
    """A safetensors file's tensor table from its JSON header alone; truncation or garbage names the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            blob = f.read(n) if 0 <= n <= min(size - 8, MAX_HEADER_BYTES) else None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror})") from None
    if blob is None:
        raise CheckpointError(f"{path}: truncated or not a safetensors file ({size} bytes)")
    try:
        raw = json.loads(blob.decode("utf-8"))
        raw.pop("__metadata__", None)
        table = {k: HeaderEntry(str(v["dtype"]), tuple(int(d) for d in v["shape"])) for k, v in raw.items()}
        end = 8 + n + max((int(v["data_offsets"][1]) for v in raw.values()), default=0)
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    if end > size:
        raise CheckpointError(f"{path}: truncated ({size} bytes, its header describes {end})")
    return table


def read_index(ckpt: Path) -> dict[str, str]:
    """tensor name -> shard file name. A single `model.safetensors` without an index is accepted too."""
    index_path = ckpt / INDEX_FILE
    if not index_path.exists():
        single = ckpt / SINGLE_FILE
        if not single.exists():
            raise CheckpointError(f"{ckpt}: no {INDEX_FILE} and no {SINGLE_FILE}")
        return dict.fromkeys(read_header(single), single.name)
    try:
        weight_map = json.loads(index_path.read_bytes().decode("utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a map of tensor name -> file name")
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{index_path}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    missing_files = sorted({f for f in weight_map.values() if not (ckpt / f).is_file()})
    if missing_files:
        raise CheckpointError(f"{index_path}: points at missing shard file(s) {', '.join(missing_files)}")
    return weight_map


def in_layers(name: str, layers: set[int]) -> bool:
    """Whether `name` belongs to one of `layers` (`model.layers.<i>.`)."""
    m = _LAYER.match(name)
    return bool(m) and int(m.group(1)) in layers


def check_coverage(weight_map: dict[str, str], cfg: ModelConfig, skip_layers: set[int]) -> None:
    """Every index entry is a spec tensor (or in a skipped layer); every spec tensor outside them is there."""
    expected = {s.name for s in checkpoint_specs(cfg)}
    unexpected = sorted(n for n in weight_map if n not in expected and not in_layers(n, skip_layers))
    if unexpected:
        raise CheckpointError(f"{len(unexpected)} tensor(s) in the index are neither used by the model nor on the "
                              f"not-loaded list: {', '.join(unexpected[:8])}")
    missing = sorted(n for n in expected if n not in weight_map and not in_layers(n, skip_layers))
    if missing:
        raise CheckpointError(missing_message(missing))


def missing_message(missing: list[str]) -> str:
    scales = [n for n in missing if n.endswith("weight_scale_inv")]
    if scales:
        return (f"{scales[0][: -len('_scale_inv')]}: FP8 weight without its scale ({scales[0]} is missing)"
                + (f"; {len(missing) - 1} more tensor(s) missing" if len(missing) > 1 else ""))
    return f"missing tensor(s): {', '.join(missing[:8])}" + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")


def tokenizer_file(ckpt: str | Path) -> Path:
    """The checkpoint's tokenizer.json; a CheckpointError naming it where it is missing."""
    path = Path(ckpt) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"tokenizer: {path} is missing (the checkpoint needs a tokenizer.json)")
    return path


def check_checkpoint(ckpt: str | Path, with_mtp: bool = False, with_tokenizer: bool = False) -> ModelConfig:
    """Everything about `ckpt` that can be checked without reading tensor data (`with_tokenizer`: that it has a
    tokenizer.json, which serving needs); returns its config."""
    ckpt = Path(ckpt)
    cfg = load_config(ckpt)
    if with_tokenizer:
        tokenizer_file(ckpt)
    weight_map = read_index(ckpt)
    skip = set() if with_mtp else set(cfg.mtp_layer_ids)
    check_coverage(weight_map, cfg, skip)
    headers = {f: read_header(ckpt / f) for f in sorted(set(weight_map.values()))}
    for spec in checkpoint_specs(cfg):
        fname = weight_map.get(spec.name)
        if fname is None:  # in a skipped layer (check_coverage let it through)
            continue
        entry = headers[fname].get(spec.name)
        if entry is None:
            raise CheckpointError(f"{spec.name}: the index places it in {fname}, which does not contain it")
        if entry.shape != spec.shape:
            kind = "scale" if spec.name.endswith("weight_scale_inv") else "tensor"
            raise CheckpointError(f"{spec.name}: {kind} has shape {list(entry.shape)} in {fname}, config.json "
                                  f"implies {list(spec.shape)}")
        if (entry.dtype == FP8_DTYPE) != (spec.dtype == "fp8"):
            raise CheckpointError(f"{spec.name}: stored as {entry.dtype} in {fname}, config.json implies "
                                  f"{FP8_DTYPE if spec.dtype == 'fp8' else 'a BF16/FP32 tensor'} "
                                  "(check quantization_config.modules_to_not_convert)")
    return cfg
