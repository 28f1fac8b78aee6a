"""Parallel state: the process group, this rank's place in TP and EP, and the groups collectives run on.

Startup chain step "init distributed backend" (after the per-rank processes are spawned, before weights
load). Owns: `init_distributed` (backend by device — NCCL for CUDA, gloo for CPU — rendezvous through
`MASTER_ADDR`/`MASTER_PORT` (`env://`) or an explicit `tcp://host:port`), `initialize_model_parallel`
(validates the TP / EP sizes and records them), and the process-wide `ParallelState` the layers read once,
at construction. Until something initialises it the state is one rank with no groups, so the unsharded
model and every single-process tool are unchanged.

Layout (SGLang's, restricted to one model replica; the rules live in distributed/layout.py): world =
max(tp, ep) ranks.
  - attention, dense MLPs, shared experts, embedding and lm_head: TP over `tp_group` (tp = world), or
    replicated (tp = 1, only with ep = world: "replicated attention + EP");
  - DP-attention (`dp_attention`, ep = world): the same modules replicated, but each rank runs them on its
    *own* batch (its own requests and KV pool); the state records tp_size = 1 and moe_a2a = True (the
    all-to-all exchange is one of its two MoE paths) and a CPU group for the per-step agreement;
  - routed experts: `moe_group` = the world; experts split ep ways, each expert's intermediate split
    moe_tp = world / ep ways. EP rank = rank // moe_tp, so ranks of one EP rank are consecutive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dsaserve.distributed.layout import Layout, check_divisions, check_sizes
from dsaserve.distributed.rank_gpu import gpu_ordinal

DEFAULT_TIMEOUT_S = 600  # first NCCL collectives can wait on slow peers (weights still loading elsewhere)


@dataclass(frozen=True)
class Group:
    """One process group as the collectives see it; `pg` is None when the group is a single rank."""

    name: str
    size: int = 1
    rank: int = 0
    pg: object | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class ParallelState:
    world_size: int = 1
    rank: int = 0
    tp_size: int = 1
    ep_size: int = 1
    moe_a2a: bool = False  # MoE via all-to-all dispatch/combine instead of one all-reduce
    dp_attention: bool = False  # each rank runs everything but the routed experts on its own batch
    backend: str = "none"
    world: Group = Group("world")
    tp_group: Group = Group("tp")
    moe_group: Group = Group("moe")
    # DP-attention: the CPU (gloo) group over which the ranks agree on every step (engine/dp_step.py); the
    # world itself when the backend is gloo
    dp_cpu_group: object | None = field(default=None, compare=False, repr=False)

    @property
    def dp_size(self) -> int:
        """Attention data-parallel ranks: batches that run side by side (1 unless DP-attention)."""
        return self.world_size if self.dp_attention else 1

    @property
    def dp_rank(self) -> int:
        """Which attention data-parallel rank this is (the TokenizerManager routes requests by it)."""
        return self.rank if self.dp_attention else 0

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank

    @property
    def moe_tp_size(self) -> int:
        """Ways each routed expert's intermediate dim is split (world / ep)."""
        return self.world_size // self.ep_size

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp_size

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp_size

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "rank": self.rank, "tp_size": self.tp_size, "tp_rank": self.tp_rank,
                "ep_size": self.ep_size, "ep_rank": self.ep_rank, "moe_tp_size": self.moe_tp_size,
                "moe_a2a": self.moe_a2a, "dp_attention": self.dp_attention, "dp_size": self.dp_size,
                "dp_rank": self.dp_rank,
                "backend": self.backend}


_STATE = ParallelState()


def get_parallel_state() -> ParallelState:
    return _STATE


def set_parallel_state(state: ParallelState) -> ParallelState:
    global _STATE
    _STATE = state
    return state


def reset_parallel_state() -> None:
    """Back to one rank (tests; a process that tears its group down)."""
    set_parallel_state(ParallelState())


def shutdown_distributed() -> None:
    """Leave the process group and go back to one rank (an Engine that closes, tests)."""
    from dsaserve.distributed import symm_mem

    symm_mem.reset()  # its buffers belong to the group being destroyed
    if dist.is_initialized():
        dist.destroy_process_group()
    reset_parallel_state()


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_distributed(world_size: int | None = None, rank: int | None = None, device: torch.device | str = "cpu",
                     init_method: str | None = None, backend: str | None = None,
                     timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Join the default process group (no-op when already joined or when the world is one rank).

    world_size / rank default to $WORLD_SIZE / $RANK; init_method to `env://` ($MASTER_ADDR, $MASTER_PORT).
    """
    if dist.is_initialized():
        return
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    if world_size <= 1:
        return
    if not 0 <= rank < world_size:
        raise ValueError(f"rank: {rank} is outside world_size {world_size}")
    if init_method is None:
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
        if missing:
            raise ValueError(f"distributed init: set {' and '.join(missing)} or pass init_method='tcp://host:port'")
        init_method = "env://"
    backend = backend or backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(local_device(device, rank, world_size))
    dist.init_process_group(backend, init_method=init_method, world_size=world_size, rank=rank,
                            timeout=timedelta(seconds=timeout_s))


def local_device(device: torch.device | str, rank: int | None = None, world_size: int | None = None) -> torch.device:
    """`cuda` without an index becomes this rank's GPU, by the rule its early CUDA context followed before torch
    (distributed/rank_gpu.py: one rank -> 0; several -> $LOCAL_RANK, else rank mod the host's GPUs).
    rank / world_size: the process group's, else $RANK / $WORLD_SIZE."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is not None:
        return device
    if world_size is None:
        world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    return torch.device("cuda", gpu_ordinal(None, world_size, rank, torch.cuda.device_count))


def initialize_model_parallel(tp_size: int = 1, ep_size: int = 1, moe_a2a: bool = False,
                              device: torch.device | str = "cpu", init_method: str | None = None,
                              rank: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                              dp_attention: bool = False) -> ParallelState:
    """Record the TP / EP / DP-attention layout (joining the process group first if needed); return the state.

    dp_attention: every rank runs attention, dense MLPs, shared experts, embedding and lm_head on its own
    batch; routed experts are split over all ranks (ep_size = world; tp_size 1 or the world size) and the MoE
    layers exchange tokens by all-to-all (moe_a2a is implied)."""
    lay = check_sizes(tp_size, ep_size, dp_attention, "tp_size", "ep_size", moe_a2a)  # before any rendezvous
    if lay.world > 1:
        init_distributed(world_size=lay.world, rank=rank, device=device, init_method=init_method,
                         timeout_s=timeout_s)
    real_world = dist.get_world_size() if dist.is_initialized() else 1
    if real_world != lay.world:
        raise ValueError(f"tp_size {tp_size} / ep_size {ep_size}: need world_size = max(tp, ep) = "
                         f"{lay.world} ranks, the process group has {real_world}")
    if real_world == 1:
        return set_parallel_state(ParallelState(moe_a2a=False))
    rank = dist.get_rank()
    world_group = Group("world", real_world, rank, dist.group.WORLD)
    dp_cpu = None
    if dp_attention:  # every rank creates it, in the same order (new_group is collective)
        dp_cpu = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(
            backend="gloo", timeout=timedelta(seconds=timeout_s))
    tp_group = Group("tp", real_world, rank, dist.group.WORLD) if lay.attn_tp > 1 else Group("tp")
    return set_parallel_state(ParallelState(
        world_size=real_world, rank=rank, tp_size=lay.attn_tp, ep_size=ep_size, moe_a2a=moe_a2a or dp_attention,
        dp_attention=bool(dp_attention), backend=dist.get_backend(), world=world_group, tp_group=tp_group,
        moe_group=Group("moe", real_world, rank, dist.group.WORLD), dp_cpu_group=dp_cpu))


def validate_for_model(cfg, state: ParallelState) -> None:
    """Every split the layout implies must be exact; errors name the flag, the config field and the numbers."""
    check_divisions(cfg, Layout(state.tp_size, state.ep_size, state.dp_attention))
