"""The greedy sampler's argmax over the logits' rows in one launch (request path stage 8: sampling).

Owns: `row_argmax`, the GPU variant of `reference.row_argmax` (torch's `argmax(-1)`: the first maximum, NaN above
every number), and its arrival counters. torch's reduction reads a batch of bf16 logits rows at ~0.9 TB/s (45.5 µs
for 128 x 154,880 on the H200, thirty-second session: one block a row); here a row is split over programs so that a
batch keeps every SM reading, each program writes its chunk's (key, index) and the row's last program to arrive
reduces the partials and writes the token id. A value's key is its float32 bits made order-preserving as an
unsigned integer (NaN above +inf, as torch orders them), so ties and NaN resolve exactly as torch's do.
Imported only by `kernels/registry.py` after it checked that Triton and a CUDA device are there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_utils import INTERPRET, made_once

BLOCK = 8192  # values a program reads per loop step: 16 KB of bf16, four 16-B loads in flight a thread
MAX_SPLITS = 64  # programs a row at most: the last one reduces their partials in one block
MAX_ROWS = 4096  # rows one launch takes (the counters' length); a larger batch takes torch's argmax
PROGRAMS_PER_SM = 4  # programs a launch aims at an SM: enough bytes in flight to read at the copy rate
KEY_NONE = tl.constexpr(-(1 << 31))  # no value's key: -inf's is -2**31 + 2**23 - 1
_WORKSPACES: dict[tuple[int | None, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _order_key(v):
    """float32 -> int32 in the float order (a negative value's magnitude bits flipped); -0 as +0 and NaN the
    largest key, as torch's argmax compares them. Every value's key is above KEY_NONE."""
    bits = tl.where(v == 0, 0.0, v).to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return tl.where(v != v, 0x7FFFFFFF, key)


@triton.jit
def _block_best(x_row, c0, end, best, best_idx, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """The running (key, index) of a program after the block at column c0 (masked: the columns before end)."""
    cols = c0 + tl.arange(0, BLOCK)
    if MASKED:
        key = tl.where(cols < end, _order_key(tl.load(x_row + cols, mask=cols < end, other=0.0).to(tl.float32)),
                       KEY_NONE)  # a masked lane never wins
    else:
        key = _order_key(tl.load(x_row + cols).to(tl.float32))
    m, i = tl.max(key, axis=0, return_indices=True, return_indices_tie_break_left=True)
    # strictly greater: an earlier block keeps a tie (the first maximum)
    return tl.maximum(best, m), tl.where(m > best, c0 + i, best_idx)


# the batch's numbers are not specialised (one compile a dtype and row stride, none after start-up's warmup); the
# chunk is passed in BLOCKs so the JIT sees every load's start 16-B aligned (vector loads)
@triton.jit(do_not_specialize=["n_cols", "chunk_blocks", "n_splits"])
def _row_argmax_kernel(x_ptr, key_ptr, idx_ptr, count_ptr, out_ptr, n_cols, stride_x, chunk_blocks, n_splits,
                       BLOCK: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start = split * chunk_blocks * BLOCK
    end = tl.minimum(start + chunk_blocks * BLOCK, n_cols)
    x_row = x_ptr + row * stride_x
    best = tl.zeros([], dtype=tl.int32) + KEY_NONE
    best_idx = tl.zeros([], dtype=tl.int32) + start
    whole_end = start + (end - start) // BLOCK * BLOCK
    for c0 in range(start, whole_end, BLOCK):  # unmasked: vector loads
        best, best_idx = _block_best(x_row, c0, end, best, best_idx, BLOCK, False)
    if whole_end < end:  # the row's last program: its partial block
        best, best_idx = _block_best(x_row, whole_end, end, best, best_idx, BLOCK, True)
    tl.store(key_ptr + row * SPLITS + split, best)
    tl.store(idx_ptr + row * SPLITS + split, best_idx)
    tl.debug_barrier()  # every thread's stores before the arrival
    if tl.atomic_add(count_ptr + row, 1, sem="acq_rel") == n_splits - 1:  # the row's last program reduces
        s = tl.arange(0, SPLITS)
        keys = tl.load(key_ptr + row * SPLITS + s, mask=s < n_splits, other=KEY_NONE, cache_modifier=".cg")
        first = tl.argmax(keys, axis=0, tie_break_left=True)  # the smallest split of the maximum: its first index
        tl.store(out_ptr + row, tl.load(idx_ptr + row * SPLITS + first, cache_modifier=".cg").to(tl.int64))
        tl.store(count_ptr + row, 0)  # zero for the next launch (stream order puts it after this one)


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(arrival counters, partial keys, partial indices) of the current stream: one int32 counter a row, zero
    between launches (each row's last program resets its own), and the programs' partials. One set a stream, made
    on its first launch (the registry makes the default stream's when it binds the GPU ops; `triton_utils.made_once`):
    launches on one stream run one after another, while two streams' launches could run at once and mix their
    arrivals."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return made_once(_WORKSPACES, (device.index, stream), device, "row_argmax's workspace",
                     lambda: (torch.zeros(MAX_ROWS, dtype=torch.int32, device=device),
                              torch.empty(MAX_ROWS, MAX_SPLITS, dtype=torch.int32, device=device),
                              torch.empty(MAX_ROWS, MAX_SPLITS, dtype=torch.int32, device=device)))


def split_plan(rows: int, n_cols: int, sms: int) -> tuple[int, int]:
    """(programs a row, values a program): PROGRAMS_PER_SM x the SM count over the batch, at least one BLOCK a
    program and at most MAX_SPLITS a row; the chunk a multiple of BLOCK so every program but the last reads whole
    blocks."""
    splits = max(1, min(triton.cdiv(PROGRAMS_PER_SM * sms, rows), triton.cdiv(n_cols, BLOCK), MAX_SPLITS))
    chunk = triton.cdiv(triton.cdiv(n_cols, splits), BLOCK) * BLOCK
    return triton.cdiv(n_cols, chunk), chunk


def _sm_count(device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return 4  # the interpreter: a few splits a row, so tests run the partials' reduction
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """GPU `reference.row_argmax`: x [rows, vocab] (bf16, fp16 or float32, unit last stride) -> int64 [rows], the
    first maximum of each row (NaN above every number), as `x.argmax(-1)`. A batch past MAX_ROWS, or another
    layout, takes torch's argmax."""
    rows, n_cols = x.shape
    if rows > MAX_ROWS or x.stride(-1) != 1 or n_cols == 0 or x.dtype not in (torch.bfloat16, torch.float16,
                                                                              torch.float32):
        return x.argmax(dim=-1)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    splits, chunk = split_plan(rows, n_cols, _sm_count(x.device))
    counters, keys, idx = workspace(x.device)
    _row_argmax_kernel[(rows, splits)](x, keys, idx, counters, out, n_cols, x.stride(0), chunk // BLOCK, splits,
                                       BLOCK=BLOCK, SPLITS=MAX_SPLITS, num_warps=8)
    return out
