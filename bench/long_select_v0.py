"""FROZEN COPY (not imported by the engine): `kernels/triton_indexer_long.py` as it was before the arrival-counter
design, kept so bench/bench_long_select.py and bench/offline_long_select.py can A/B the two in one run.

Long-row decode selection of the DSA indexer (request path stage 6, full indexer layers).

Owns: `long_row_select`, the top-k of score rows too long for one program, and `launches`, its kernel launches.
`triton_indexer_dispatch` sends a decode batch here when its static row bound (page_table.shape[1] * page_size)
exceeds `triton_indexer.ROW_IN_REGS_MAX` (16K keys); shorter bounds keep the one-program-per-row kernel there;
`triton_indexer_gemm` sends prefill rows past that bound.

Why: one program per row searches a 32K-key row over L2 with a single SM (~150 µs per row on the H200),
and the model's context goes to 202752 keys. Here every row is split into CHUNK-key chunks, one program
each, and the k-th largest score is found by an exact radix select on the 32-bit order key
(`triton_indexer._order_key32`), 8 bits per round, with no program ever waiting for another:
  round r (4 launches): each program histograms digit r of its chunk's keys whose higher digits equal the
      prefix chosen so far (256 bins, `tl.histogram`: warp ballots, no per-key atomics), and adds the
      non-zero bins to the row's global histogram with atomics. The prefix itself is re-derived by every
      program from the earlier rounds' histograms (`_bucket`: 256-bin suffix sums), so no "last program"
      hand-off and no inter-program barrier (which could deadlock under PDL or a side stream);
      A round whose chosen bucket is taken whole (`need` equals its count: on random-like scores the
      24-bit bucket of the k-th key usually holds that key alone) ends the search: the later rounds'
      programs return before reading a score;
  count: after the rounds the prefix is the k-th largest score's key T (or its resolved top bits) and `need`
      says how many keys equal to T are taken; each chunk counts its keys above T and equal to T;
  write: each chunk takes an exclusive prefix over the earlier chunks' counts and writes its slots in
      position order (ties in position order), so the output equals the one-program kernel's, bit for bit.
Rows whose token sees at most k keys take them all and read no score (the scores kernel skipped them).
Six launches (+ one memset), each a pass over the row's causal prefix in L2 (five when round 3 is
skipped); a round costs the same whatever the data (the 256-bin radix dropped in `triton_indexer`
serialised on shared-memory atomics when all keys share their top byte; a ballot histogram does not).
Chunks past a token's position return at once.
One compiled variant per chunk size (and round), whatever the row length and the page table: a prefill's rows are
as long as its context and its page table as wide as its longest request, so the chunk count and the page-table
stride are not specialised and the write kernel sums the earlier chunks' counts PREFIX_BLOCK at a time (a block
sized by the chunk count compiled a variant per power of two of it: the H200's bench compiled one after Up for a
131072-token chunk). tests/kernels/test_select_variants.py compiles them offline to check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_indexer import _order_key32, _rank_2d
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

CHUNK = 4096  # keys per program: 16 per thread at 8 warps
ROUNDS = 4  # 8-bit digits of the 32-bit order key
BINS = 256
# chunks whose counts the write kernel sums per step: the model's 202752-key rows in 2048-key chunks (the prefill
# select's) are 99, one step
PREFIX_BLOCK = tl.constexpr(128)


@triton.jit
def _chunk_keys(row_ptr, c, pos, n_cols, CHUNK: tl.constexpr):
    """(positions, visible, unsigned order key as int64 in [0, 2^32)) of chunk c of a score row."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    vis = (j <= pos) & (j < n_cols)
    x = tl.load(row_ptr + j, mask=vis, other=float("-inf"))
    return j, vis, _order_key32(x).to(tl.int64) + 2147483648


@triton.jit
def _bucket(hist_row, k, R: tl.constexpr):
    """(prefix, need, shift, done) after R rounds: the k-th largest key u has u >> shift == prefix, and
    `need` (>= 1) of the keys with that prefix are in the top k. Round r's digit is the largest one whose
    suffix count (keys of the current bucket with digit >= it) still reaches `need`. done: the bucket was
    resolved at an earlier round (every key of it is taken: need == its count), so the later rounds were
    skipped (their histograms stay zero) and shift stays at that round's: 32 - 8 x (rounds used)."""
    # counts in int32 (a row has < 2^31 keys): every program runs these 256-wide scans, int64 costs twice
    prefix = tl.zeros([], dtype=tl.int64)
    need = tl.zeros([], dtype=tl.int32) + k
    shift = tl.zeros([], dtype=tl.int32) + 32
    done = need < 0  # False
    b = tl.arange(0, 256)
    for r in tl.static_range(R):
        h = tl.load(hist_row + r * 256 + b)
        at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
        d = tl.sum((at_or_above >= need).to(tl.int32), axis=0) - 1
        new_need = need - tl.sum(tl.where(b > d, h, 0), axis=0)
        resolved = new_need == tl.sum(tl.where(b == d, h, 0), axis=0)
        prefix = tl.where(done, prefix, prefix * 256 + d)
        need = tl.where(done, need, new_need)
        shift = tl.where(done, shift, shift - 8)
        done = done | resolved
    return prefix, need, shift, done


@triton.jit
def _radix_round_kernel(score_ptr, pos_ptr, hist_ptr, n_cols, k, stride_s, ROUND: tl.constexpr,
                        CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    if (pos < k) | (c * CHUNK > pos):  # takes every key / past the token's position
        return
    hist_row = hist_ptr + row * (4 * 256)
    prefix, _, _, done = _bucket(hist_row, k, ROUND)
    if done:  # the k-th key's bucket is taken whole: no more digits needed (scores read by none)
        return
    _, vis, u = _chunk_keys(score_ptr + row * stride_s, c, pos, n_cols, CHUNK)
    match = vis & ((u >> (32 - 8 * ROUND)) == prefix)
    digit = ((u >> (24 - 8 * ROUND)) & 255).to(tl.int32)
    h = tl.histogram(digit, 256, mask=match)
    tl.atomic_add(hist_row + ROUND * 256 + tl.arange(0, 256), h, mask=h > 0)


@triton.jit(do_not_specialize=["n_chunks"])
def _chunk_count_kernel(score_ptr, pos_ptr, hist_ptr, cnt_ptr, n_cols, k, stride_s, n_chunks,
                        CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """cnt[row, c] = (keys above the k-th key T, keys equal to T) in chunk c."""
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    if (pos < k) | (c * CHUNK > pos):
        return
    _, vis, u = _chunk_keys(score_ptr + row * stride_s, c, pos, n_cols, CHUNK)
    key, _, shift, _ = _bucket(hist_ptr + row * (4 * 256), k, 4)
    u = u >> shift  # compared at the resolved digit: a bucket taken whole counts as ties, all needed
    out = cnt_ptr + (row * n_chunks + c) * 2
    tl.store(out, tl.sum((vis & (u > key)).to(tl.int32), axis=0))
    tl.store(out + 1, tl.sum((vis & (u == key)).to(tl.int32), axis=0))


@triton.jit
def _write_all_visible(pt_row, out_row, c, pos, k, page_size, CHUNK: tl.constexpr):
    """A token that sees at most k keys: chunk c's part of [slots of keys 0..pos, -1, ...] (k columns)."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    page = tl.load(pt_row + j // page_size, mask=j <= pos, other=0)
    tl.store(out_row + j, tl.where(j <= pos, page * page_size + j % page_size, -1), mask=j < k)


@triton.jit(do_not_specialize=["stride_pt", "n_chunks"])
def _chunk_write_kernel(score_ptr, pt_ptr, req_ptr, pos_ptr, hist_ptr, cnt_ptr, out_ptr, n_cols, k, page_size,
                        stride_s, stride_pt, stride_o, n_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Chunk c's selected keys -> physical slots at their rank among the row's selection (position order):
    every key above T, then the ties at T in position order until `need` are taken."""
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    pt_row = pt_ptr + tl.load(req_ptr + row).to(tl.int64) * stride_pt
    out_row = out_ptr + row * stride_o
    if pos < k:
        if c * CHUNK < k:
            _write_all_visible(pt_row, out_row, c, pos, k, page_size, CHUNK)
        return
    if c * CHUNK > pos:
        return
    key, need, shift, _ = _bucket(hist_ptr + row * (4 * 256), k, 4)
    # the earlier chunks' counts, PREFIX_BLOCK at a time (a fixed block, not one sized by the row's chunk count:
    # that made a variant per power of two of it, and a prefill's row length is its context's)
    above_before = tl.zeros([], dtype=tl.int32)
    ties_before = tl.zeros([], dtype=tl.int32)
    for q0 in range(0, c, PREFIX_BLOCK):
        q = q0 + tl.arange(0, PREFIX_BLOCK)
        before = cnt_ptr + (row * n_chunks + q) * 2
        above_before += tl.sum(tl.load(before, mask=q < c, other=0), axis=0)
        ties_before += tl.sum(tl.load(before + 1, mask=q < c, other=0), axis=0)
    base = above_before + tl.minimum(need, ties_before).to(tl.int32)
    C: tl.constexpr = 128
    j = c * CHUNK + (tl.arange(0, CHUNK // C) * C)[:, None] + tl.arange(0, C)[None, :]
    vis = (j <= pos) & (j < n_cols)
    x = tl.load(score_ptr + row * stride_s + j, mask=vis, other=float("-inf"))
    u = (_order_key32(x).to(tl.int64) + 2147483648) >> shift
    eq = (vis & (u == key)).to(tl.int32)
    take = (eq == 1) & (ties_before + _rank_2d(eq) - 1 < need)
    sel = ((vis & (u > key)) | take).to(tl.int32)
    page = tl.load(pt_row + j // page_size, mask=sel == 1, other=0)
    tl.store(out_row + base + _rank_2d(sel) - 1, page * page_size + j % page_size, mask=sel == 1)


def long_row_select(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor,
                    positions: torch.Tensor, out: torch.Tensor, k: int, page_size: int, chunk: int = CHUNK) -> None:
    """out [rows, >= k] (int64) <- the k largest causal scores' physical slots per row, in position order,
    -1 padded for tokens that see fewer than k keys. scores [rows, n_cols] fp32 (rows of tokens whose
    position is below k may be unwritten: they are not read). No host sync: capturable in a CUDA graph."""
    for kernel, grid, args, kwargs in launches(scores, page_table, req_index, positions, out, k, page_size, chunk):
        kernel[grid](*args, **kwargs)


def launches(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
             out: torch.Tensor, k: int, page_size: int, chunk: int = CHUNK) -> list[tuple]:
    """`long_row_select`'s launches in order, as (kernel, grid, arguments, keywords), its workspaces allocated
    (tests compile them offline: one variant per chunk size, whatever the row length or page-table width)."""
    rows, n_cols = scores.shape
    if rows == 0:
        return []
    if chunk % 128:
        raise ValueError(f"long_row_select: chunk {chunk} is not a multiple of 128")
    n_chunks = triton.cdiv(n_cols, chunk)
    hist = torch.zeros((rows, ROUNDS, BINS), dtype=torch.int32, device=scores.device)
    counts = torch.empty((rows, n_chunks, 2), dtype=torch.int32, device=scores.device)
    grid = (rows, n_chunks)
    # 16 keys a thread (4096-key chunks: 8 warps), 4..16 warps
    launch = {"CHUNK": chunk, "num_warps": min(16, max(4, chunk // 512)), **pdl_args(scores.device)}
    return [*((_radix_round_kernel, grid, (scores, positions, hist, n_cols, k, scores.stride(0)),
               {"ROUND": r, **launch}) for r in range(ROUNDS)),
            (_chunk_count_kernel, grid, (scores, positions, hist, counts, n_cols, k, scores.stride(0), n_chunks),
             launch),
            (_chunk_write_kernel, grid, (scores, page_table, req_index, positions, hist, counts, out, n_cols, k,
                                         page_size, scores.stride(0), page_table.stride(0), out.stride(0), n_chunks),
             launch)]
