"""The long-row decode selection of a few rows in one launch (request path stage 6, full indexer layers).

Owns: `coop_select`, the same top-k as `triton_indexer_long.long_row_select` (its radix rounds, count and write,
bit for bit) as one `_coop_select_kernel` launch: a barrier among a row's programs stands where the launches had a
launch boundary, every program keeps its chunk's keys in registers and chooses each round's digit itself from the
row's complete histogram. `cooperative` is decode's choice (`triton_indexer_dispatch`): its 1-2 rows where every
program can be resident at once. H200, graph-timed (bench/RESULTS.md, nineteenth session): one row of 32K keys
16.7 -> 12.4 us, of 128K 20.5-23.1 -> 15.7-17.8; two rows 17.4-19.5 -> 12.8-14.6 and 22.8-24.1 -> 18.1-19.3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_fp8_gemm import _sm_count
from dsaserve.kernels.triton_indexer_long import (
    BINS,
    DIGITS,
    PREFIX_BLOCK,
    STATE,
    WS_ROW,
    _choose_digit,
    _chunk_keys,
    _count_digit,
    _last_visible,
    _write_all_visible,
    _write_selected,
    _writer,
    workspace,
)
from dsaserve.kernels.triton_utils import INTERPRET, grid_dependency_sync

COOP_BARRIERS = tl.constexpr(8)  # a row's state: the ROUNDS + 1 barrier counters (state 8..12, after the launches')
# decode rows up to which one cooperative launch replaces the select's launches (`cooperative`; not under the
# interpreter: it runs a launch's programs one after another, so a barrier among them would never open)
COOP_ROWS = 0 if INTERPRET else 2


@triton.jit
def _row_barrier(counter, n_active):
    """Wait until the row's n_active programs have all arrived at this counter (zeroed for the launch). The CTA
    barrier and the release order every thread's earlier global writes and atomics before the arrival; the
    acquire orders the others' before what follows. Only for launches whose programs are all resident together
    (`_coop_select_kernel`)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="release") + 1
    while arrived < n_active:  # polled with plain L2 reads (not read-modify-writes on the one address)
        arrived = tl.load(counter, volatile=True)
    tl.atomic_add(counter, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit(do_not_specialize=["stride_pt", "n_chunks"])
def _coop_select_kernel(score_ptr, pt_ptr, req_ptr, pos_ptr, ws_ptr, cnt_ptr, out_ptr, n_cols, k, page_size,
                        stride_s, stride_pt, stride_o, n_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """The split radix select in one launch for a few rows (COOP_ROWS): the rounds, the count and the write of
    `launches` with a barrier among the row's programs between them instead of a launch boundary. Each program
    reads its chunk's scores once and keeps them; every program chooses each round's digit itself from the row's
    complete histogram (the same numbers, so the same choice and the same early end); the output equals the
    launches', bit for bit. Deadlock-free because `coop_select` takes it only for at most one program an SM (rows x
    chunks <= the SM count): each program finds an SM once the kernels beside it end, and none of them waits for
    this one (on the side stream, the select's only consumer joins after it)."""
    grid_dependency_sync(PDL)
    row, c, pos, pt_row, out_row = _writer(pos_ptr, pt_ptr, req_ptr, out_ptr, stride_pt, stride_o)
    if pos < k:
        _write_all_visible(pt_row, out_row, c, n_chunks, pos, k, page_size, CHUNK)
        return
    if c * CHUNK > pos:  # past the position: not one of the row's n_active programs
        return
    ws = ws_ptr + row * WS_ROW
    n_active = tl.minimum(pos // CHUNK, n_chunks - 1) + 1
    lim = _last_visible(pos, n_cols)
    row_ptr = score_ptr + row * stride_s
    vis, u = _chunk_keys(row_ptr, c, lim, CHUNK)
    prefix = tl.zeros([], dtype=tl.uint32)
    need = tl.zeros([], dtype=tl.int32) + k
    shift = tl.zeros([], dtype=tl.int32)
    done = tl.zeros([], dtype=tl.int32)
    for D in tl.static_range(DIGITS):
        if done == 0:
            _count_digit(ws + D * BINS, u, vis, prefix, lim, c, D, CHUNK)
            _row_barrier(ws + STATE + COOP_BARRIERS + D, n_active)
            d, need, resolved = _choose_digit(ws + D * BINS, need)
            prefix = prefix * 256 + d.to(tl.uint32)
            shift = tl.zeros([], dtype=tl.int32) + (24 - 8 * D)
            done = resolved.to(tl.int32)
    key = u >> shift
    above = tl.sum((vis & (key > prefix)).to(tl.int32), axis=0)
    ties = tl.sum((vis & (key == prefix)).to(tl.int32), axis=0)
    cnt_row = cnt_ptr + row * n_chunks * 4
    tl.store(cnt_row + c * 4, above)
    tl.store(cnt_row + c * 4 + 1, ties)
    _row_barrier(ws + STATE + COOP_BARRIERS + DIGITS, n_active)
    above_before = tl.zeros([], dtype=tl.int32)
    ties_before = tl.zeros([], dtype=tl.int32)
    for q0 in range(0, c, PREFIX_BLOCK):
        q = q0 + tl.arange(0, PREFIX_BLOCK)
        m = q < c
        above_before += tl.sum(tl.load(cnt_row + q * 4, mask=m, other=0, cache_modifier=".cg"), axis=0)
        ties_before += tl.sum(tl.load(cnt_row + q * 4 + 1, mask=m, other=0, cache_modifier=".cg"), axis=0)
    _write_selected(row_ptr, pt_row, out_row, c, pos, n_cols, page_size, prefix, need, shift, above, ties,
                    above_before, ties_before, CHUNK, True)


def coop_fits(rows: int, n_chunks: int, scores: torch.Tensor) -> bool:
    """Whether a cooperative launch of rows x n_chunks programs is safe: one program an SM at most, so each finds an
    SM once the kernels beside it end and all are resident together (a GPU shared through MPS with an SM limit is
    not seen here)."""
    return rows * n_chunks <= _sm_count(scores)


def cooperative(rows: int, n_cols: int, chunk: int, scores: torch.Tensor) -> bool:
    """Decode's choice (`triton_indexer_dispatch`): its 1-2 rows (COOP_ROWS) as one cooperative launch where it fits.
    A prefill's rows keep the launches (its late slots and window pass; none of its kernels runs beside it)."""
    return rows <= COOP_ROWS and coop_fits(rows, triton.cdiv(n_cols, chunk), scores)


def launch(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
           out: torch.Tensor, k: int, page_size: int, chunk: int) -> tuple:
    """`coop_select`'s one launch as (kernel, grid, arguments, keywords), its workspace zeroed here (tests compile
    it offline); an error where `coop_fits` says no or under the interpreter (never a launch that could wait forever
    at its first barrier)."""
    ws, counts, grid, kw = workspace(scores, chunk)
    if INTERPRET or not coop_fits(*grid, scores):
        raise ValueError(f"long_row_select: a cooperative launch of {grid[0]} x {grid[1]} programs "
                         f"{'under the interpreter' if INTERPRET else 'passes the SM count'}")
    return (_coop_select_kernel, grid, (scores, page_table, req_index, positions, ws, counts, out, scores.shape[1], k,
                                        page_size, scores.stride(0), page_table.stride(0), out.stride(0), grid[1]), kw)


def coop_select(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
                out: torch.Tensor, k: int, page_size: int, chunk: int) -> None:
    """`triton_indexer_long.long_row_select`'s output in one launch (rows of one program an SM at most)."""
    if scores.shape[0]:
        kernel, grid, args, kw = launch(scores, page_table, req_index, positions, out, k, page_size, chunk)
        kernel[grid](*args, **kw)
