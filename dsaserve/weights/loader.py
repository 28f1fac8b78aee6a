"""Checkpoint loader: safetensors shards -> model parameters, with a coverage check (startup chain step
"load weights (+ coverage check)").

Owns: reading `model.safetensors.index.json`, opening shards lazily (memory-mapped by safetensors), the one
explicit name table (checkpoint name -> parameter + slice), and the errors that make a bad checkpoint fail
at startup instead of as drifting outputs: a missing tensor, an FP8 weight without its `weight_scale_inv`,
a scale or weight of the wrong shape or dtype, a NaN/Inf in a weight or scale (checked on every tensor as
it is copied: one pass over its bytes), a tensor the index places in a shard that lacks it, a
truncated/corrupt shard, an index naming a missing file, and any tensor neither consumed nor on the
explicit not-loaded list (the index and coverage rules are `checkpoint_check`'s, shared with `serve`'s
torch-free pre-flight). Every failure is a one-line `CheckpointError` naming the tensor or file.
Under expert parallelism `not_mine()` puts other ranks' experts on that list (with the owning rank)
and `route()` maps a kept expert to its local slot; under tensor parallelism a parameter that carries
`.shard` (set by its layer) receives only its slice of the checkpoint tensor.
"""

from __future__ import annotations

import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from dsaserve.distributed.sharding import ExpertPlacement, shard_source
from dsaserve.errors import CheckpointError
from dsaserve.weights.checkpoint_check import check_coverage, in_layers, read_index

__all__ = ["CheckpointError", "LoadReport", "Target", "load_checkpoint", "not_mine", "route"]

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale_inv)$")


@dataclass
class LoadReport:
    """What the startup manifest shows about weights."""

    checkpoint: str
    tensors_loaded: int = 0
    bytes_loaded: int = 0
    shards: int = 0
    seconds: float = 0.0
    not_loaded: dict[str, str] = field(default_factory=dict)  # tensor -> why it was skipped on purpose
    phases: dict[str, float] = field(default_factory=dict)  # the "load_weights" phase's parts (the runner's)

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "tensors_loaded": self.tensors_loaded,
                "bytes_loaded": self.bytes_loaded, "shards": self.shards, "seconds": round(self.seconds, 3),
                "not_loaded": self.not_loaded_by_reason(), "phases": dict(self.phases)}

    def not_loaded_by_reason(self) -> dict[str, dict]:
        """Skipped tensors grouped by why (a full list of 1000s of MTP/EP names helps nobody reading /startup)."""
        groups: dict[str, list[str]] = defaultdict(list)
        for name, why in sorted(self.not_loaded.items()):
            groups[why].append(name)
        return {why: {"count": len(names), "examples": names[:3]} for why, names in groups.items()}


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter, optionally a slice of it (stacked experts)."""

    param: str
    index: tuple = ()  # indices into the parameter (expert id, then a row slice)


def route(name: str, cfg, inter_blocks: int, placement: ExpertPlacement | None = None) -> Target:
    """The name table. Identity for everything but per-expert tensors, which stack into w13 / w2 (at the
    expert's local slot, with this rank's intermediate rows, when `placement` shards the experts)."""
    m = _EXPERT.match(name)
    if not m:
        return Target(name)
    prefix, j, proj, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    scale = kind == "weight_scale_inv"
    param = f"{prefix}.{'w2' if proj == 'down' else 'w13'}{'_scale' if scale else ''}"
    inter = cfg.moe_intermediate_size
    if placement is not None:
        j, inter = placement.local(j), placement.param_inter
        inter_blocks = -(-inter // 128)  # FP8 block rows of this rank's gate (or up) part
    if proj == "down":
        return Target(param, (j,))
    rows = inter_blocks if scale else inter  # gate = first half, up = second half
    start = 0 if proj == "gate" else rows
    return Target(param, (j, slice(start, start + rows)))


def not_mine(name: str, placement: ExpertPlacement | None) -> str | None:
    """Why this rank skips `name` on purpose (a routed expert another EP rank holds), or None."""
    m = _EXPERT.match(name)
    if placement is None or not m or placement.is_mine(int(m.group(2))):
        return None
    last = placement.first + placement.count - 1
    return (f"routed expert {m.group(2)} is held by EP rank {placement.owner(int(m.group(2)))} of "
            f"{placement.ep_size}; this rank holds experts {placement.first}-{last}")


def _check_and_copy(name: str, tensor: torch.Tensor, param: torch.Tensor, target: Target,
                    check_finite: bool = True) -> int:
    """Copy `tensor` (this rank's slice of it) into its place in `param`; returns the bytes kept."""
    tensor = shard_source(param, tensor, name.endswith("weight_scale_inv"))  # this rank's TP slice, if sharded
    dest = param.data[target.index] if target.index else param.data
    if tuple(tensor.shape) != tuple(dest.shape):
        kind = "scale" if name.endswith("weight_scale_inv") else "tensor"
        raise CheckpointError(f"{name}: {kind} has shape {list(tensor.shape)}, the model expects {list(dest.shape)}")
    if (tensor.dtype == torch.float8_e4m3fn) != (dest.dtype == torch.float8_e4m3fn):
        raise CheckpointError(f"{name}: stored as {tensor.dtype}, the model expects {dest.dtype} "
                              "(check quantization_config.modules_to_not_convert)")
    dest.copy_(tensor.to(dest.dtype))
    if check_finite:
        _refuse_non_finite(name, dest)
    return tensor.numel() * tensor.element_size()


def _refuse_non_finite(name: str, dest: torch.Tensor) -> None:
    """A NaN/Inf weight or scale would be served as garbage (all-zero tokens, NaN logprobs): refuse it here.
    One pass over the bytes just copied. FP8 e4m3fn has no Inf; its NaNs are the bit patterns S.1111.111."""
    if dest.dtype == torch.float8_e4m3fn:
        bad = int(((dest.view(torch.uint8) & 0x7F) == 0x7F).sum())
    elif dest.is_floating_point():
        bad = int((~torch.isfinite(dest)).sum())
    else:
        return
    if bad:
        raise CheckpointError(f"{name}: {bad} non-finite value(s) (NaN/Inf) of {dest.numel()}; "
                              "the checkpoint is corrupt")


def load_checkpoint(model: torch.nn.Module, ckpt: str | Path, progress: bool | None = None) -> LoadReport:
    """Load every tensor of the checkpoint into `model` (a DsaForCausalLM) and verify coverage."""
    t0, ckpt = time.perf_counter(), Path(ckpt)
    cfg = model.cfg
    weight_map = read_index(ckpt)
    params = dict(model.named_parameters())
    report = LoadReport(str(ckpt))
    skip_layers = set() if model.with_mtp else set(cfg.mtp_layer_ids)
    inter_blocks = -(-cfg.moe_intermediate_size // 128)
    placement = _expert_placement(model)

    check_coverage(weight_map, cfg, skip_layers)
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, fname in weight_map.items():
        if in_layers(name, skip_layers):
            report.not_loaded[name] = "MTP layer not loaded (enable_mtp=False: the engine does not speculate yet)"
        elif why := not_mine(name, placement):
            report.not_loaded[name] = why
        else:
            by_file[fname].append(name)

    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=sum(len(v) for v in by_file.values()), desc="loading weights", unit="tensor", disable=not show)
    filled: set[str] = set()
    for fname, names in sorted(by_file.items()):
        _load_shard(ckpt / fname, names, params, cfg, inter_blocks, report, bar, placement, filled)
    bar.close()
    # the other direction of the coverage check: no parameter may be left as allocated (torch.empty)
    unfilled = sorted(set(params) - filled)
    if unfilled:
        raise CheckpointError(f"model parameter(s) no checkpoint tensor filled: {', '.join(unfilled[:8])}")
    report.shards = len(by_file)
    report.seconds = time.perf_counter() - t0
    return report


def load_dummy(model: torch.nn.Module, seed: int = 0) -> LoadReport:
    """`--load-format dummy`: the tensors `make-checkpoint` would write (same names, init and FP8 blocks),
    drawn on the model's device instead of read from files, through the same routing and TP / EP slicing as a
    checkpoint. Each tensor is drawn whole from its own seeded generator, so every layout of ranks holds the
    parts of one and the same model (TP2 gives TP1's tokens), and a rank draws only the experts it holds."""
    from dsaserve.weights.checkpoint_writer import random_tensor, stored_tensors, tensor_generator_seed
    from dsaserve.weights.spec import checkpoint_specs

    t0, cfg = time.perf_counter(), model.cfg
    device = next(model.parameters()).device
    params, report, filled = dict(model.named_parameters()), LoadReport("dummy"), set()
    skip_layers = set() if model.with_mtp else set(cfg.mtp_layer_ids)
    inter_blocks, placement = -(-cfg.moe_intermediate_size // 128), _expert_placement(model)
    gen = torch.Generator(device=device)
    mine = [s for s in checkpoint_specs(cfg) if not in_layers(s.name, skip_layers) and not not_mine(s.name, placement)]
    draw = lambda spec: random_tensor(cfg, spec, seed, gen.manual_seed(tensor_generator_seed(seed, spec.name)))
    for name, tensor in stored_tensors(mine, draw):
        target = route(name, cfg, inter_blocks, placement)
        # drawn finite by construction: no per-tensor non-finite scan (a device sync each, at start-up)
        report.bytes_loaded += _check_and_copy(name, tensor, params[target.param], target, check_finite=False)
        report.tensors_loaded += 1
        filled.add(target.param)
    unfilled = sorted(set(params) - filled)
    if unfilled:
        raise CheckpointError(f"model parameter(s) the dummy weights did not fill: {', '.join(unfilled[:8])}")
    report.seconds = time.perf_counter() - t0
    return report


def _expert_placement(model: torch.nn.Module) -> ExpertPlacement | None:
    """The routed-expert split the model was built with (None: every expert whole on this rank)."""
    placement = next((m.placement for m in model.modules() if isinstance(getattr(m, "placement", None),
                                                                            ExpertPlacement)), None)
    return placement if placement is not None and placement.sharded else None


def _load_shard(path: Path, names: list[str], params: dict, cfg, inter_blocks: int, report: LoadReport,
                bar: tqdm, placement: ExpertPlacement | None, filled: set[str]) -> None:
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for truncated/corrupt headers
        raise CheckpointError(f"{path}: cannot read shard ({e})") from None
    with handle as f:
        present = set(f.keys())  # noqa: SIM118
        for name in names:
            if name not in present:
                raise CheckpointError(f"{name}: the index places it in {path.name}, which does not contain it")
            try:
                tensor = f.get_tensor(name)
            except Exception as e:
                raise CheckpointError(f"{name}: cannot read it from {path.name} (truncated or corrupt: {e})") from None
            target = route(name, cfg, inter_blocks, placement)
            if target.param not in params:
                raise CheckpointError(f"{name}: maps to parameter {target.param}, which the model does not have")
            report.bytes_loaded += _check_and_copy(name, tensor, params[target.param], target)
            report.tensors_loaded += 1
            filled.add(target.param)
            bar.update(1)
