"""Weight shards: which slice of a checkpoint tensor this rank keeps, and which routed experts it owns.

Owns: `Shard` (part `rank` of `parts` equal parts of one dim of a [.., N, K] weight — dim 0 = N, the
output rows of a column-parallel layer; dim 1 = K, the input columns of a row-parallel one), its FP8 rule,
and `ExpertPlacement` (the experts and the intermediate slice a rank holds). Startup chain: "load
weights" — a parameter that carries `.shard` gets the checkpoint tensor sliced by the loader
(`shard_source`); layers set it at construction, beside the code that knows the split.

FP8 block scales (one float per 128x128 block) are sliced with their weight: a split of N splits the
scale's block rows, a split of K its block columns. That is only exact when each part is a whole number of
128-blocks. When it is not (the tiny CI configs: 4 heads x 48 q_b rows over 2 ranks), the layer keeps the
*full* FP8 weight + scale through loading and slices after dequantising (`deferred`); keeping FP8 for the
GPU kernels then is an error naming the layer and the TP size (`require_fp8_aligned`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsaserve.config import FP8_BLOCK
from dsaserve.distributed.parallel_state import ParallelState


@dataclass(frozen=True)
class Shard:
    dim: int  # 0: N (rows, column-parallel), 1: K (columns, row-parallel) of the last two dims
    rank: int
    parts: int

    def size(self, full: int) -> int:
        if full % self.parts:
            raise ValueError(f"shard: {full} is not divisible into {self.parts} parts")
        return full // self.parts

    def local_shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        out = list(full)
        axis = len(full) - 2 + self.dim
        out[axis] = self.size(full[axis])
        return tuple(out)

    def aligned(self, full: tuple[int, ...]) -> bool:
        """True if every part is a whole number of FP8 blocks (so the scale can be sliced exactly)."""
        return self.size(full[len(full) - 2 + self.dim]) % FP8_BLOCK == 0

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of a weight [.., N, K]."""
        axis = t.dim() - 2 + self.dim
        n = self.size(t.shape[axis])
        return t.narrow(axis, self.rank * n, n)

    def take_blocks(self, scale: torch.Tensor) -> torch.Tensor:
        """This rank's block rows / columns of a `weight_scale_inv` (the weight's part must be aligned)."""
        return self.take(scale)

    def describe(self) -> str:
        return f"{'rows' if self.dim == 0 else 'columns'} part {self.rank}/{self.parts}"


def shard_source(param: torch.Tensor, tensor: torch.Tensor, is_scale: bool) -> torch.Tensor:
    """The loader's hook: the slice of a checkpoint tensor that `param` holds (all of it if unsharded)."""
    shard: Shard | None = getattr(param, "shard", None)
    if shard is None:
        return tensor
    return shard.take_blocks(tensor) if is_scale else shard.take(tensor)


def mark_sharded(shard: Shard | None, *params: torch.Tensor | None) -> None:
    for p in params:
        if p is not None and shard is not None:
            p.shard = shard


def tp_shard(state: ParallelState, dim: int) -> Shard | None:
    return Shard(dim, state.tp_rank, state.tp_size) if state.tp_size > 1 else None


def fp8_misaligned(name: str, shard: Shard, full: tuple[int, int]) -> str:
    n = shard.size(full[shard.dim])
    return (f"{name}: {shard.parts} ranks leave {n} {'rows' if shard.dim == 0 else 'columns'} of {full[shard.dim]} "
            f"per rank, not a multiple of {FP8_BLOCK}; FP8 kernels need 128-aligned shards (lower tp/ep, or run "
            "the reference path, which dequantises before slicing)")


@dataclass(frozen=True)
class ExpertPlacement:
    """The routed experts of one rank: [first, first + count) of `total`, each with intermediate rows
    part `inter_shard` (moe_tp > 1) — or every expert whole on a single rank."""

    total: int
    first: int
    count: int
    inter: int  # full moe_intermediate_size
    inter_shard: Shard | None  # split of the intermediate dim, None when moe_tp = 1
    deferred: bool  # FP8 and the intermediate part is not 128-aligned: hold full rows, slice after dequant
    ep_size: int = 1

    @staticmethod
    def build(cfg, state: ParallelState, quantized: bool) -> ExpertPlacement:
        count = cfg.n_routed_experts // state.ep_size
        inter_shard = Shard(0, state.moe_tp_rank, state.moe_tp_size) if state.moe_tp_size > 1 else None
        deferred = bool(inter_shard and quantized and (cfg.moe_intermediate_size // state.moe_tp_size) % FP8_BLOCK)
        return ExpertPlacement(cfg.n_routed_experts, state.ep_rank * count, count, cfg.moe_intermediate_size,
                               inter_shard, deferred, state.ep_size)

    @property
    def sharded(self) -> bool:
        return self.count != self.total or self.inter_shard is not None

    @property
    def param_inter(self) -> int:
        """Intermediate rows each expert's parameter holds during loading (full when deferred)."""
        return self.inter if self.inter_shard is None or self.deferred else self.inter // self.inter_shard.parts

    def owner(self, expert: int) -> int:
        return expert // self.count

    def is_mine(self, expert: int) -> bool:
        return self.first <= expert < self.first + self.count

    def local(self, expert: int) -> int:
        return expert - self.first


def require_fp8_aligned(model: torch.nn.Module) -> None:
    """Before loading for the FP8 GPU path: every sharded FP8 layer must split on 128-block boundaries."""
    for m in model.modules():
        why = getattr(m, "fp8_misaligned", None)
        if why:
            raise ValueError(why)
