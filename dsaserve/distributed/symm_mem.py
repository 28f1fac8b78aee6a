"""Decode-size all-reduces over NVLink through torch's symmetric memory, instead of NCCL's ring.

Owns: one symmetric buffer per process group, allocated and exchanged once at the startup chain's
"communication warm-up" (`enable`), and `all_reduce_in_place(x, group)`: the sum, in place, by torch's
one-shot kernel (every rank reads each peer's copy of the message straight over NVLink and adds them; a
barrier on the buffer's signal pad orders the reads). It needs no NVLink multicast (the device machines
keep it off), and it captures into CUDA graphs. It answers False where NCCL must run the call instead: not
CUDA, a message larger than the buffer or not a whole number of 16-byte vectors, a dtype other than
bf16/fp32, a group `enable` did not set up.

Why: NCCL's ring costs ~12 µs per decode-size all-reduce inside a CUDA graph on two H200s (bench/RESULTS.md,
"Two GPUs"), against the ledger's 5 µs; glm-5.3-x2 at TP2 makes 32 of them a step. One-shot moves
(n-1) x message per rank where the ring moves 2(n-1)/n x message: at n = 2 the same wire bytes, at n = 8
3.5x more, which is why it is kept to small messages (`MAX_BYTES`). The counting wrapper still counts the
ring's wire bytes: the ledger's convention (DESIGN.md "The ledger"), unchanged by the algorithm.
`DSASERVE_SYMM_MEM=0` turns it off (NCCL for every call).
"""

from __future__ import annotations

import torch

from dsaserve.common import envs

MAX_BYTES = 2 << 20  # covers a decode step's hidden state up to 128 rows x 7168 (DeepSeek-V3.2) in bf16
DTYPES = (torch.bfloat16, torch.float32)
ALIGN = 16  # bytes: the one-shot kernel moves 16-byte vectors; hidden states (H a multiple of 128) always are
_BUFFERS: dict[int, tuple[torch.Tensor, str, bool]] = {}  # id(process group) -> (uint8 symmetric buffer, group
# name, whether torch has the fused copy-in op: looked up once at `enable`, not per call)


def available(device: torch.device) -> tuple[bool, str]:
    """(usable, why not) for this device and torch build."""
    if device.type != "cuda":
        return False, f"device {device.type}"
    if not envs.DSASERVE_SYMM_MEM:
        return False, "DSASERVE_SYMM_MEM=0"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as e:
        return False, f"no symmetric memory in this torch ({e})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return False, "torch.ops.symm_mem.one_shot_all_reduce_out missing"
    return True, ""


def enable(pg: object, device: torch.device) -> str | None:
    """Allocate and exchange this group's buffer (collective: every rank of the group calls it, in the same
    order). Returns None when enabled, else why NCCL keeps every all-reduce (for the startup manifest)."""
    ok, why = available(device)
    if not ok:
        return why
    if id(pg) in _BUFFERS:
        return None
    import torch.distributed._symmetric_memory as symm

    name = pg.group_name
    try:
        buf = symm.empty(MAX_BYTES, dtype=torch.uint8, device=device)
        symm.rendezvous(buf, name)
    except (RuntimeError, ValueError) as e:  # e.g. no P2P between the GPUs: NCCL does every call
        return f"symmetric memory rendezvous failed: {e}"[:300]
    _BUFFERS[id(pg)] = (buf, name, hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"))
    return None


def all_reduce_in_place(x: torch.Tensor, pg: object) -> bool:
    """x <- the sum of every rank's x, through the group's symmetric buffer; False (x untouched) where NCCL
    must do it. x must be contiguous."""
    entry = _BUFFERS.get(id(pg))
    nbytes = x.numel() * x.element_size()
    if entry is None or not x.is_cuda or x.dtype not in DTYPES or nbytes > MAX_BYTES or nbytes % ALIGN:
        return False
    buf, name, fused_copy = entry
    staged = buf[:nbytes].view(x.dtype)
    flat = x.view(-1)
    if fused_copy:  # the copy in fused: one kernel
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(staged, flat, "sum", name, flat)
    else:
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", name, flat)
    return True


def reset() -> None:
    """Forget every buffer (the process group is being destroyed)."""
    _BUFFERS.clear()
