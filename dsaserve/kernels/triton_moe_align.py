"""GPU `moe_align`: sort (token, expert) pairs by expert, each expert's run padded to BLOCK_M (issue 17).

Owns: the Triton kernels behind `triton_moe.moe_align` and the prefill route's inverse permutation.
  1. count (`_align_count_kernel`, one program a CHUNK of pairs): the chunk's histogram over the experts;
  2. scan (`_align_scan_kernel`, one program): per-expert totals, padded run starts, and for every (chunk,
     expert) the slot its first pair goes to, minus the pair's place in the chunk's expert-sorted order;
  3. scatter (`_align_scatter_kernel`, one program a chunk): the chunk's pairs sorted by (expert, index) in
     registers (`tl.sort`), so pair p of the sorted chunk lands at base[chunk, expert] + p; also writes
     pos[pair] = its slot (-1 for an absent expert's pair) and, in programs past the chunks' count too,
     the expert of each BLOCK_M block.
Stable past ONE_LAUNCH_PAIRS, as the torch version was (`moe_align_torch`, kept as the spec and the CPU
fallback): pairs of an expert keep their order. Every size is static (CUDA-graph capturable); the torch version
took ~12 launches and a device sort (368 us for 32K pairs on the H200), this is 4 launches (one fill) of a few
us each.
Up to ONE_LAUNCH_PAIRS pairs (decode batches) `_align_one_kernel` does all of it in one program, each pair's
slot from an atomic increment: the same runs, blocks and total, an expert's pairs in the atomics' order.
Bins: experts 0..E-1, E (an absent expert's pairs: one last run past the total), E+1 (a chunk's tail).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_utils import INTERPRET, grid_dependency_sync, pdl_args

ALIGN_CHUNK = 1024  # pairs a count / scatter program sorts (a bitonic sort of 1024 int32 in registers)
# pairs up to which one program does all of it (`_align_one_kernel`, slots by atomics: one launch and no sort,
# where the three kernels and the fill took 19.6-20.4 us at 128 tokens x top-8 on the H200, and one program that
# sorted 18.5: bench/RESULTS.md, twenty-seventh session); one binary for every such size (decode batches 33-256)
ONE_LAUNCH_PAIRS = 2048
ALIGN_BLOCK_BINS = 16384  # (M block, bin) comparisons a scatter program makes to find its blocks' experts


def moe_align_torch(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe_align` in torch ops (the spec of the kernels below; CPU tensors without the interpreter)."""
    flat = topk_ids.reshape(-1)
    n = flat.numel()
    max_blocks = triton.cdiv(n + (num_experts + 1) * (block_m - 1), block_m)
    dev = flat.device
    counts, padded, pcum = _padded_runs(flat, num_experts, block_m)
    start = counts.cumsum(0) - counts
    sorted_e, order = torch.sort(flat, stable=True)
    rank = torch.arange(n, device=dev) - start[sorted_e]
    dest = (pcum - padded)[sorted_e] + rank
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(max_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pcum, block_start, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, pcum[num_experts - 1:num_experts].to(torch.int32)


def _padded_runs(flat: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """(pairs, padded run length, padded run end) of each bin [E + 1] (experts, then the absent expert's)."""
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))
    padded = (counts + block_m - 1) // block_m * block_m
    return counts, padded, padded.cumsum(0)


def run_ends_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> torch.Tensor:
    """[E] int32: where each expert's padded run ends in `moe_align`'s order (the spec of `align_route`'s ends)."""
    return _padded_runs(topk_ids.reshape(-1), num_experts, block_m)[2][:num_experts].to(torch.int32)


def _route_torch(flat: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, ...]:
    """`align_route` from `moe_align_torch`: pos is the inverse of sorted_ids over the live pairs."""
    n = flat.numel()
    sorted_ids, bexp, total = moe_align_torch(flat, num_experts, block_m)
    pos = torch.full((n,), -1, dtype=torch.int32, device=flat.device)
    slots = torch.arange(int(total), dtype=torch.int32, device=flat.device)
    live = sorted_ids[:int(total)]
    pos[live[live < n].long()] = slots[live < n]
    return sorted_ids, bexp, total, pos, run_ends_torch(flat, num_experts, block_m)


# Every size below is a constexpr of the expert count alone and no pair / chunk / block count is specialised:
# one binary per (experts, BLOCK_M), so no batch size compiles a kernel after start-up (a 32K-token prefill
# once did: the scan's tile had followed the chunk count).
@triton.jit(do_not_specialize=["n"])
def _align_count_kernel(ids_ptr, counts_ptr, n, BINS: tl.constexpr, CHUNK: tl.constexpr):
    """counts[chunk, bin] = pairs of the chunk routed to bin (the tail past n counts in bin BINS - 1)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < n, other=BINS - 1).to(tl.int32)
    tl.store(counts_ptr + c * BINS + tl.arange(0, BINS), tl.histogram(e, BINS))


@triton.jit
def _write_runs(counts, pend_ptr, total_ptr, num_experts, BINS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each bin's run padded to BLOCK_M from its pair count: stores pend (where each run ends; bins past the absent
    expert's a large value) and total (where expert E-1's run ends); returns (padded, pend)."""
    bins = tl.arange(0, BINS)
    live = bins <= num_experts  # experts and the absent bin; the tail bin never lands anywhere
    padded = tl.where(live, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    pend = tl.cumsum(padded, axis=0)
    tl.store(pend_ptr + bins, tl.where(live, pend, 2**30))
    tl.store(total_ptr, tl.sum(tl.where(bins < num_experts, padded, 0), axis=0))
    return padded, pend


@triton.jit
def _write_block_experts(pend, bexp_ptr, blocks, num_experts, max_blocks, BLOCK_M: tl.constexpr):
    """The expert of each BLOCK_M block: searchsorted(pend, its first slot, right=True), the runs ending at or
    before that slot (blocks past the total: the last expert's, never run)."""
    expert = tl.sum((pend[None, :] <= (blocks * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(bexp_ptr + blocks, tl.minimum(expert, num_experts - 1), mask=blocks < max_blocks)


@triton.jit(do_not_specialize=["num_chunks"])
def _align_scan_kernel(counts_ptr, base_ptr, pend_ptr, total_ptr, num_chunks, num_experts,
                       BINS: tl.constexpr, CB: tl.constexpr, BLOCK_M: tl.constexpr):
    """base[c, e] = start of e's padded run + e's pairs in chunks before c - pairs before e's in chunk c;
    pend[e] = end of e's padded run (bins past E: a large value); total = end of expert E-1's run."""
    bins = tl.arange(0, BINS)
    offs_c = tl.arange(0, CB)
    totals = tl.zeros([BINS], dtype=tl.int32)
    for c0 in range(0, num_chunks, CB):
        rows = c0 + offs_c
        tile = tl.load(counts_ptr + rows[:, None] * BINS + bins[None, :], mask=rows[:, None] < num_chunks, other=0)
        totals += tl.sum(tile, axis=0)
    padded, pend = _write_runs(totals, pend_ptr, total_ptr, num_experts, BINS, BLOCK_M)
    run = pend - padded  # e's next free slot past the chunks done
    for c0 in range(0, num_chunks, CB):
        rows = c0 + offs_c
        cmask = rows[:, None] < num_chunks
        tile = tl.load(counts_ptr + rows[:, None] * BINS + bins[None, :], mask=cmask, other=0)
        before = tl.cumsum(tile, axis=0) - tile  # e's pairs in the tile's earlier chunks
        local = tl.cumsum(tile, axis=1) - tile  # pairs of lower bins in the same chunk
        tl.store(base_ptr + rows[:, None] * BINS + bins[None, :], run[None, :] + before - local, mask=cmask)
        run += tl.sum(tile, axis=0)


@triton.jit(do_not_specialize=["n", "num_chunks", "max_blocks"])
def _align_scatter_kernel(ids_ptr, base_ptr, pend_ptr, sorted_ptr, pos_ptr, bexp_ptr, n, num_chunks, num_experts,
                          max_blocks, BINS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                          NB: tl.constexpr):
    """Chunk c's pairs to their slots (sorted_ids, pos); M blocks [c*NB, (c+1)*NB) to their experts."""
    c = tl.program_id(0)
    if c < num_chunks:
        idx = tl.arange(0, CHUNK)
        offs = c * CHUNK + idx
        e = tl.load(ids_ptr + offs, mask=offs < n, other=BINS - 1).to(tl.int32)
        key = tl.sort(e * CHUNK + idx)  # (expert, index) order: stable within the chunk
        se = key // CHUNK
        pair = c * CHUNK + key % CHUNK
        keep = se <= num_experts
        dest = tl.load(base_ptr + c * BINS + se, mask=keep, other=0) + idx
        tl.store(sorted_ptr + dest, pair, mask=keep)
        tl.store(pos_ptr + pair, tl.where(se < num_experts, dest, -1), mask=keep)
    pend = tl.load(pend_ptr + tl.arange(0, BINS))
    _write_block_experts(pend, bexp_ptr, c * NB + tl.arange(0, NB), num_experts, max_blocks, BLOCK_M)


@triton.jit(do_not_specialize=["n", "max_blocks"])
def _align_one_kernel(ids_ptr, next_ptr, pend_ptr, total_ptr, sorted_ptr, pos_ptr, bexp_ptr, n, num_experts,
                      max_blocks, BINS: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, NB: tl.constexpr,
                      PDL: tl.constexpr = False):
    """The three kernels' work for n <= CHUNK pairs in one program, each pair's slot taken with an atomic
    increment of its expert's next free slot (no sort): the order of an expert's pairs among its slots is the
    atomics' (not stable), which changes no GEMM output (each pair's row is computed from its own activation row
    alone) and no combine (decode's reads pair t*k + j of token t, prefill's by pos)."""
    grid_dependency_sync(PDL)
    idx = tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + idx, mask=idx < n, other=BINS - 1).to(tl.int32)
    padded, pend = _write_runs(tl.histogram(e, BINS), pend_ptr, total_ptr, num_experts, BINS, BLOCK_M)
    tl.store(next_ptr + tl.arange(0, BINS), pend - padded)
    for s0 in range(0, max_blocks * BLOCK_M, CHUNK):  # padding slots hold n (no pair)
        tl.store(sorted_ptr + s0 + idx, tl.zeros([CHUNK], dtype=tl.int32) + n, mask=s0 + idx < max_blocks * BLOCK_M)
    tl.debug_barrier()  # the run starts and the fill before any thread's atomics and scatter (other threads' stores)
    keep = (idx < n) & (e <= num_experts)
    dest = tl.atomic_add(next_ptr + e, 1, mask=keep, sem="relaxed")
    tl.store(sorted_ptr + dest, idx, mask=keep)
    tl.store(pos_ptr + idx, tl.where(e < num_experts, dest, -1), mask=keep)
    for b0 in range(0, max_blocks, NB):
        _write_block_experts(pend, bexp_ptr, b0 + tl.arange(0, NB), num_experts, max_blocks, BLOCK_M)


def align_route(topk_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, block_expert, total, pos, ends): `moe_align`'s three outputs, pos [T*k] int32, the slot of
    each pair in sorted_ids (-1 for an absent expert's pair, id num_experts), and ends [E] int32, where each
    expert's padded run ends (expert e's rows are [ends[e-1], ends[e]), ends[-1] = total). Up to ONE_LAUNCH_PAIRS
    pairs an expert's run holds its pairs in no fixed order (`_align_one_kernel`); above, in pair order."""
    flat = topk_ids.reshape(-1).contiguous()
    n = flat.numel()
    dev = flat.device
    if not (flat.is_cuda or INTERPRET):  # CPU tensors outside the interpreter (offline compiles, tools)
        return _route_torch(flat, num_experts, block_m)
    max_blocks = triton.cdiv(n + (num_experts + 1) * (block_m - 1), block_m)
    bins = triton.next_power_of_2(num_experts + 2)
    pend = torch.empty(bins, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    pos = torch.empty(n, dtype=torch.int32, device=dev)
    bexp = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    if 0 < n <= ONE_LAUNCH_PAIRS:
        sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
        next_slot = torch.empty(bins, dtype=torch.int32, device=dev)
        _align_one_kernel[(1,)](flat, next_slot, pend, total, sorted_ids, pos, bexp, n, num_experts, max_blocks,
                                BINS=bins, CHUNK=ONE_LAUNCH_PAIRS, BLOCK_M=block_m, NB=64, num_warps=8,
                                **pdl_args(dev))
        return sorted_ids, bexp, total, pos, pend[:num_experts]
    chunk = ALIGN_CHUNK
    chunks = triton.cdiv(n, chunk)
    counts = torch.empty(max(chunks, 1), bins, dtype=torch.int32, device=dev)
    base = torch.empty_like(counts)
    sorted_ids = torch.full((max_blocks * block_m,), n, dtype=torch.int32, device=dev)
    if chunks:
        _align_count_kernel[(chunks,)](flat, counts, n, BINS=bins, CHUNK=chunk)
    cb = max(1, 8192 // bins)
    _align_scan_kernel[(1,)](counts, base, pend, total, chunks, num_experts, BINS=bins, CB=cb, BLOCK_M=block_m)
    nb = max(16, ALIGN_BLOCK_BINS // bins)
    grid = max(chunks, triton.cdiv(max_blocks, nb))
    _align_scatter_kernel[(grid,)](flat, base, pend, sorted_ids, pos, bexp, n, chunks, num_experts, max_blocks,
                                   BINS=bins, CHUNK=chunk, BLOCK_M=block_m, NB=nb)
    return sorted_ids, bexp, total, pos, pend[:num_experts]
