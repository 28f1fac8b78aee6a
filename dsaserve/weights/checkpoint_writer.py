"""Random-weight checkpoints in the real HF FP8 layout (`dsaserve make-checkpoint`).

Owns: writing exactly the tensors of `spec.checkpoint_specs(cfg)` as safetensors shards
`model-0000i-of-0000n.safetensors` + `model.safetensors.index.json`, with `config.json`,
`generation_config.json` and the tokenizer files beside them. Startup chain: this is what the loader
reads in tests and on machines without real weights.

Determinism: every tensor has its own torch.Generator seeded from sha256(seed, tensor name), so a
tensor's values do not depend on which other tensors exist or in what order they are written; the
shard plan depends only on the spec; safetensors orders its header itself, and the JSON files are
written with sorted keys. Same seed -> byte-identical files.
Memory: one shard's tensors at a time (real checkpoints shard at ~5 GB, so do we).
Initialisation is chosen so a random model still has a well-separated greedy argmax (see `_init_std`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dsaserve.config import ModelConfig
from dsaserve.weights.checkpoint_check import INDEX_FILE
from dsaserve.weights.fp8 import quantize_fp8_block
from dsaserve.weights.spec import TensorSpec, checkpoint_specs

SHARD_TARGET_BYTES = 5 * 10**9  # HF `max_shard_size="5GB"`, the size the GLM-5 / DeepSeek releases use
STORAGE_DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class CheckpointSummary:
    """What `write_checkpoint` wrote, for the CLI's report."""

    path: Path
    num_tensors: int
    total_bytes: int  # sum of tensor bytes, as the index's metadata.total_size
    shards: tuple[str, ...]


def _unit_key(spec: TensorSpec) -> str:
    """Tensors with the same key stay in one shard: a decoder layer's tensors, or a weight and its scale."""
    m = _LAYER.match(spec.name)
    if m:
        return f"layer.{m.group(1)}"
    return spec.name.removesuffix(".weight_scale_inv").removesuffix(".weight")


def _group(specs: list[TensorSpec], key) -> list[list[TensorSpec]]:
    groups: list[list[TensorSpec]] = []
    last = None
    for s in specs:
        k = key(s)
        if not groups or k != last:
            groups.append([])
        groups[-1].append(s)
        last = k
    return groups


def _partition(units: list[list[TensorSpec]], n: int) -> list[list[TensorSpec]]:
    """Split contiguous units into n non-empty shards, each boundary near a multiple of total/n bytes."""
    sizes = [sum(s.nbytes for s in u) for u in units]
    total = sum(sizes)
    shards: list[list[TensorSpec]] = [[]]
    done = 0
    for i, (unit, size) in enumerate(zip(units, sizes, strict=True)):
        s, left_units, left_shards = len(shards) - 1, len(units) - i, n - len(shards)
        past_target = done + size / 2 > total * (s + 1) / n
        if shards[-1] and left_shards > 0 and (past_target or left_units <= left_shards):
            shards.append([])
        shards[-1].extend(unit)
        done += size
    return shards


def plan_shards(cfg: ModelConfig, num_shards: int | None = None) -> list[list[TensorSpec]]:
    """The shard plan: a list of shards, each a list of tensor specs, in spec order."""
    specs = checkpoint_specs(cfg)
    total = sum(s.nbytes for s in specs)
    n = max(2, math.ceil(total / SHARD_TARGET_BYTES)) if num_shards is None else num_shards
    if n < 2:
        raise ValueError(f"num_shards: must be at least 2 (the real layout is sharded), got {n}")
    units = _group(specs, _unit_key)
    if len(units) < n:  # more shards than layers: split layers, but never a weight from its scale
        units = _group(specs, lambda s: s.name.removesuffix("_scale_inv"))
    if len(units) < n:
        raise ValueError(f"num_shards: {n} is more than the {len(units)} weight tensors this config has")
    return _partition(units, n)


def tensor_generator_seed(seed: int, name: str) -> int:
    """Each tensor's own generator seed: a tensor's values never depend on which others were drawn first."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_std(cfg: ModelConfig, spec: TensorSpec) -> tuple[float, float]:
    """(mean, std) of the float32 init, chosen so random logits have std ~4 and a clear greedy argmax."""
    name, h = spec.name, cfg.hidden_size
    if len(spec.shape) == 1:
        if name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            return 0.0, 0.05
        return 1.0, 0.05  # RMSNorm / LayerNorm gains
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    if name == "lm_head.weight":
        return 0.0, 4.0 / math.sqrt(h)  # final norm gives unit-RMS rows, so logits get std ~4
    return 0.0, 1.0 / math.sqrt(spec.shape[-1])  # linears incl. router gate and indexer weights_proj


def random_tensor(cfg: ModelConfig, spec: TensorSpec, seed: int, gen: torch.Generator | None = None) -> torch.Tensor:
    """The float32 values of one weight (before storage-dtype conversion); `gen` (already seeded with
    `tensor_generator_seed`) draws them on its device instead of the CPU (`--load-format dummy`)."""
    g = gen if gen is not None else torch.Generator().manual_seed(tensor_generator_seed(seed, spec.name))
    mean, std = _init_std(cfg, spec)
    return torch.randn(spec.shape, generator=g, dtype=torch.float32, device=g.device).mul_(std).add_(mean)


def stored_tensors(shard: list[TensorSpec], values: Callable[[TensorSpec], torch.Tensor]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, stored tensor) for these specs, in order; `values(spec)` gives a weight's float values before
    storage (FP8 weights are quantised here and their scale follows under its own spec)."""
    scales: dict[str, torch.Tensor] = {}
    for spec in shard:
        if spec.name in scales:
            t = scales.pop(spec.name)
        elif spec.dtype == "fp8":
            t, scale = quantize_fp8_block(values(spec))
            scales[spec.name + "_scale_inv"] = scale
        else:
            t = values(spec).to(STORAGE_DTYPES[spec.dtype])
        if tuple(t.shape) != spec.shape or t.dtype != STORAGE_DTYPES[spec.dtype]:
            raise RuntimeError(f"{spec.name}: produced {t.dtype} {tuple(t.shape)}, spec says {spec.dtype} {spec.shape}")
        yield spec.name, t
    if scales:
        raise RuntimeError(f"spec lists fp8 weights without their scale: {sorted(scales)}")


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def generation_config(cfg: ModelConfig) -> dict:
    """Greedy-friendly generation defaults: no sampling unless a request asks for it."""
    eos = list(cfg.eos_token_id) if len(cfg.eos_token_id) > 1 else cfg.eos_token_id[0]
    out = {"bos_token_id": cfg.bos_token_id, "eos_token_id": eos, "do_sample": False}
    if cfg.pad_token_id is not None:
        out["pad_token_id"] = cfg.pad_token_id
    return out


def write_checkpoint(cfg: ModelConfig, out_dir: str | Path, seed: int = 0, num_shards: int | None = None) -> Path:
    """Write a random-weight checkpoint of `cfg` into out_dir (created if missing); return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_shards(cfg, num_shards)
    from dsaserve.weights.tokenizer_builder import write_tokenizer  # here: the dummy loader needs none of it

    write_tokenizer(cfg, out)  # first: it checks bos/eos ids against the config before any big write
    return _write_shards(cfg, out, lambda spec: random_tensor(cfg, spec, seed), plan)


def write_checkpoint_from_tensors(cfg: ModelConfig, out_dir: str | Path, tensors: Mapping[str, torch.Tensor],
                                  num_shards: int | None = None) -> Path:
    """Write given float weights (e.g. a trained model's) in the same layout as `write_checkpoint`.

    `tensors` has exactly the spec's weight names (no `weight_scale_inv`: FP8 weights are quantised here,
    with their block scales) and shapes; anything missing or extra is a ValueError naming it. The caller
    writes the tokenizer files (`tokenizer_builder.save_tokenizer`)."""
    specs = [s for s in checkpoint_specs(cfg) if not s.name.endswith("_scale_inv")]
    want = {s.name: s.shape for s in specs}
    missing, extra = sorted(set(want) - set(tensors)), sorted(set(tensors) - set(want))
    if missing or extra:
        raise ValueError(f"tensors: missing {missing[:5]} ({len(missing)}), unexpected {extra[:5]} ({len(extra)})")
    bad = [n for n, shape in want.items() if tuple(tensors[n].shape) != shape]
    if bad:
        raise ValueError(f"tensors: {bad[0]} has shape {tuple(tensors[bad[0]].shape)}, the spec says {want[bad[0]]}")
    plan = plan_shards(cfg, num_shards)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return _write_shards(cfg, out, lambda spec: tensors[spec.name].detach().float().cpu(), plan)


def _write_shards(cfg: ModelConfig, out: Path, values: Callable[[TensorSpec], torch.Tensor],
                  plan: list[list[TensorSpec]]) -> Path:
    from safetensors.torch import save_file  # here: the dummy loader imports this module for random_tensor

    n = len(plan)
    total = sum(s.nbytes for shard in plan for s in shard)
    weight_map: dict[str, str] = {}
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="make-checkpoint", disable=not sys.stderr.isatty())
    for i, shard in enumerate(plan):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors = dict(stored_tensors(shard, values))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        del tensors
        weight_map.update((s.name, fname) for s in shard)
        bar.update(sum(s.nbytes for s in shard))
    bar.close()
    _write_json(out / INDEX_FILE, {"metadata": {"total_size": total}, "weight_map": weight_map})
    (out / "config.json").write_text(cfg.to_json() + "\n")
    _write_json(out / "generation_config.json", generation_config(cfg))
    return out


def summarize_checkpoint(path: str | Path) -> CheckpointSummary:
    """Tensors, bytes and shards of a written checkpoint, read back from its index."""
    p = Path(path)
    index = json.loads((p / INDEX_FILE).read_text())
    shards = tuple(sorted(set(index["weight_map"].values())))
    return CheckpointSummary(p, len(index["weight_map"]), int(index["metadata"]["total_size"]), shards)
