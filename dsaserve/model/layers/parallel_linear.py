"""Tensor-parallel linear layers (stage 6): column-parallel (split output rows) and row-parallel (split
input columns, then one all-reduce) — Megatron's pair, as SGLang uses them for MLA heads and MLPs.

Owns: holding this rank's part of a [N, K] checkpoint weight and its FP8 block scales, and the all-reduce a
row-parallel layer ends with. With one TP rank both are exactly `Linear`. The split rule lives here (the
parameter carries `.shard`, the loader slices by it); when a part is not a whole number of 128-blocks the
FP8 weight is held whole until `finalize`, which dequantises and then slices (see distributed/sharding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.distributed.collectives import all_reduce
from dsaserve.distributed.parallel_state import Group, get_parallel_state
from dsaserve.distributed.sharding import Shard, fp8_misaligned, mark_sharded, tp_shard
from dsaserve.kernels.reference import dequant_fp8_weight
from dsaserve.model.layers.linear import Linear
from dsaserve.weights.spec import scale_shape


class ShardedLinear(Linear):
    """Linear over this rank's `shard` of a [out_features, in_features] weight (None = the whole weight)."""

    def __init__(self, in_features: int, out_features: int, quantized: bool, shard: Shard | None, name: str = "",
                 reduce_group: Group | None = None):
        full = (out_features, in_features)
        deferred = bool(shard is not None and quantized and not shard.aligned(full))
        held = full if shard is None or deferred else shard.local_shape(full)
        super().__init__(held[1], held[0], quantized)
        self.shard, self.name, self.full_shape, self.deferred = shard, name, full, deferred
        self.reduce_group = reduce_group if reduce_group is not None and reduce_group.size > 1 else None
        self.fp8_misaligned = fp8_misaligned(name, shard, full) if self.deferred else ""
        if shard is not None and not self.deferred:
            mark_sharded(shard, self.weight, self.weight_scale_inv)
        if self.deferred:  # count the bytes of the part this rank will read, not the whole weight held for now
            n, k = shard.local_shape(full)
            self.disk_bytes = n * k + 4 * scale_shape((n, k))[0] * scale_shape((n, k))[1]

    def finalize(self, dtype: torch.dtype, keep_fp8: bool) -> None:
        if not self.deferred:
            return super().finalize(dtype, keep_fp8)
        if keep_fp8:
            raise ValueError(self.fp8_misaligned)
        dense = dequant_fp8_weight(self.weight.data, self.weight_scale_inv.data, dtype)
        self.weight = nn.Parameter(self.shard.take(dense).contiguous(), requires_grad=False)
        self.weight_scale_inv = None
        self.out_features, self.in_features = self.weight.shape
        self.keep_fp8 = self.deferred = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return all_reduce(y, self.reduce_group) if self.reduce_group is not None else y

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", {self.shard.describe()}" if self.shard else "")


def column_parallel(in_features: int, out_features: int, quantized: bool, name: str = "") -> ShardedLinear:
    """Output rows split over TP ranks (q_b_proj and kv_b_proj by head, gate/up by intermediate row)."""
    return ShardedLinear(in_features, out_features, quantized, tp_shard(get_parallel_state(), 0), name)


def row_parallel(in_features: int, out_features: int, quantized: bool, name: str = "",
                 reduce_results: bool = True) -> ShardedLinear:
    """Input columns split over TP ranks; partial sums all-reduced unless the caller reduces them itself."""
    state = get_parallel_state()
    return ShardedLinear(in_features, out_features, quantized, tp_shard(state, 1), name,
                         state.tp_group if reduce_results else None)
