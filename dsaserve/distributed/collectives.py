"""The one wrapper every collective goes through: it runs the torch.distributed call and counts it.

Owns: `all_reduce`, `all_gather` (into a new tensor along any dim), `reduce_scatter`, `all_to_all` (with
split sizes) and `broadcast`, and the measured side of the ledger's communication terms (request path
stages 5, 6 and 8; startup chain "warmup: one collective of every kind"). On a one-rank group each call is
a no-op and counts nothing. Otherwise, per call, on every rank (kind = the function name):

  collective_calls.<kind>       +1
  collective_bytes.<kind>       the message: bytes of the logical tensor the collective is about —
                                all_reduce / broadcast: the tensor; all_gather: the gathered output;
                                reduce_scatter: the full input; all_to_all: this rank's input (what it sends,
                                its own split included; summed over ranks = the ledger's sender total).
  collective_wire_bytes.<kind>  what this rank puts on the wire under the ring algorithms the ledger assumes
                                (DESIGN.md "The ledger"): all_reduce 2(n-1)/n x message; all_gather,
                                reduce_scatter, broadcast (n-1)/n x message (`ring_wire_factor`); all_to_all
                                the bytes of the splits addressed to other ranks (the ledger estimates them
                                as (n-1)/n of the message: experts spread evenly).

Counting happens on the host; inside a captured CUDA graph the calls are not re-counted at replay (the graph
runner re-adds a warm forward's deltas, as it does for weight bytes).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dsaserve.common.counters import COLLECTIVE_KINDS, COUNTERS, ring_wire_factor
from dsaserve.distributed import symm_mem
from dsaserve.distributed.parallel_state import Group, get_parallel_state

KINDS = COLLECTIVE_KINDS
# torch 2.13 renamed the *_tensor single-tensor forms; the GPU machine runs 2.11, which has only the old names
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _count(kind: str, message: int, wire: float) -> None:
    COUNTERS.add(f"collective_calls.{kind}")
    COUNTERS.add(f"collective_bytes.{kind}", message)
    COUNTERS.add(f"collective_wire_bytes.{kind}", wire)


def _group(group: Group | None) -> Group:
    return get_parallel_state().world if group is None else group


_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


def all_reduce(x: torch.Tensor, group: Group | None = None, op: str = "sum") -> torch.Tensor:
    """Reduce (sum by default; min/max for startup agreement) over the group, in place; returns x."""
    g = _group(group)
    if op not in _OPS:
        raise ValueError(f"all_reduce: op {op!r} not one of {', '.join(_OPS)}")
    if g.size == 1:
        return x
    x = x.contiguous()
    _count("all_reduce", _nbytes(x), _nbytes(x) * ring_wire_factor("all_reduce", g.size))
    if op == "sum" and symm_mem.all_reduce_in_place(x, g.pg):  # decode-size messages on NVLink
        return x
    dist.all_reduce(x, op=_OPS[op], group=g.pg)
    return x


def all_gather(x: torch.Tensor, group: Group | None = None, dim: int = 0, out: torch.Tensor | None = None
               ) -> torch.Tensor:
    """Concatenate every rank's x (equal shapes) along `dim`, in rank order, into a new tensor (or into `out`, of
    the gathered shape, in the one copy that puts the ranks' parts in place)."""
    g = _group(group)
    if g.size == 1:
        return x if out is None else out.copy_(x)
    x = x.contiguous()
    gathered = torch.empty((g.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)  # rank-major rows
    _count("all_gather", _nbytes(gathered), _nbytes(gathered) * ring_wire_factor("all_gather", g.size))
    _all_gather_single(gathered, x, group=g.pg)
    if dim < 0:
        dim += x.dim()
    if dim == 0:
        return gathered if out is None else out.copy_(gathered)
    parts = gathered.view(g.size, *x.shape).movedim(0, dim)  # [.., n, x.shape[dim], ..]
    if out is not None:
        out.view(parts.shape).copy_(parts)
        return out
    return parts.reshape(*x.shape[:dim], g.size * x.shape[dim], *x.shape[dim + 1:])


def reduce_scatter(x: torch.Tensor, group: Group | None = None, dim: int = 0) -> torch.Tensor:
    """Sum over the group and keep this rank's 1/n slice of `dim` (which must divide evenly)."""
    g = _group(group)
    if g.size == 1:
        return x
    if dim < 0:
        dim += x.dim()
    if x.shape[dim] % g.size:
        raise ValueError(f"reduce_scatter: dim {dim} has {x.shape[dim]} rows, not divisible by {g.size} ranks")
    src = x.movedim(dim, 0).contiguous()
    out = torch.empty((src.shape[0] // g.size, *src.shape[1:]), dtype=x.dtype, device=x.device)
    _count("reduce_scatter", _nbytes(src), _nbytes(src) * ring_wire_factor("reduce_scatter", g.size))
    _reduce_scatter_single(out, src, group=g.pg)
    return out.movedim(0, dim)


def all_to_all(x: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int],
               group: Group | None = None) -> torch.Tensor:
    """Rows input_split_sizes[d] of x go to rank d; rows output_split_sizes[s] arrive from rank s (rank order)."""
    g = _group(group)
    if len(output_split_sizes) != g.size or len(input_split_sizes) != g.size:
        raise ValueError(f"all_to_all: split sizes need {g.size} entries, got {len(output_split_sizes)} / "
                         f"{len(input_split_sizes)}")
    if sum(input_split_sizes) != x.shape[0]:
        raise ValueError(f"all_to_all: input splits sum to {sum(input_split_sizes)}, x has {x.shape[0]} rows")
    if g.size == 1:
        return x
    x = x.contiguous()
    row = x.element_size() * math.prod(x.shape[1:])  # bytes of one row
    out = torch.empty((sum(output_split_sizes), *x.shape[1:]), dtype=x.dtype, device=x.device)
    _count("all_to_all", _nbytes(x), (x.shape[0] - input_split_sizes[g.rank]) * row)
    dist.all_to_all_single(out, x, [int(s) for s in output_split_sizes], [int(s) for s in input_split_sizes],
                           group=g.pg)
    return out


def broadcast(x: torch.Tensor, src: int = 0, group: Group | None = None) -> torch.Tensor:
    """Every rank gets rank `src`'s x (group rank), in place; returns x."""
    g = _group(group)
    if g.size == 1:
        return x
    if not x.is_contiguous():
        raise ValueError("broadcast: x must be contiguous (it is received in place)")
    _count("broadcast", _nbytes(x), _nbytes(x) * ring_wire_factor("broadcast", g.size))
    dist.broadcast(x, src=dist.get_global_rank(g.pg, src) if g.pg is not dist.group.WORLD else src, group=g.pg)
    return x


def warmup(device: torch.device | str, group: Group | None = None) -> list[str]:
    """Startup chain "warmup": one collective of every kind (first NCCL calls set up channels and buffers),
    uncounted so per-step reconciliation sees only the model's own calls, and the symmetric-memory buffer of
    small all-reduces (`symm_mem`). Returns what it ran, and how small all-reduces go."""
    g = _group(group)
    if g.size == 1:
        return []
    off = symm_mem.enable(g.pg, torch.device(device))
    x = torch.ones(g.size, 4, device=device)
    enabled, COUNTERS.enabled = COUNTERS.enabled, False
    try:
        all_reduce(x.clone(), g)
        all_gather(x[:1], g)
        reduce_scatter(x.clone(), g)
        all_to_all(x.clone(), [1] * g.size, [1] * g.size, g)
        broadcast(x.clone(), 0, g)
    finally:
        COUNTERS.enabled = enabled
    return [*KINDS, f"all_reduce <= {symm_mem.MAX_BYTES >> 20} MiB: " + (
        "symmetric memory one-shot" if off is None else f"NCCL ({off})")]
