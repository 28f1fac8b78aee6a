"""Long-row decode selection of the DSA indexer (request path stage 6, full indexer layers).

Owns: `long_row_select`, the top-k of score rows too long for one program, and `launches`, its kernel launches.
`triton_indexer_dispatch` sends a decode batch here when its static row bound (page_table.shape[1] * page_size)
exceeds `triton_indexer.ROW_IN_REGS_MAX` (16K keys); shorter bounds keep the one-program-per-row kernel there;
`triton_indexer_gemm` sends prefill rows past that bound (2048-key chunks).

Why: one program per row searches a 32K-key row over L2 with a single SM (~150 µs per row on the H200),
and the model's context goes to 202752 keys. Here every row is split into CHUNK-key chunks, one program
each, and the k-th largest score is found by an exact radix select on the 32-bit order key
(`triton_indexer._order_key32` + 2^31, as uint32), 8 bits per round, with no program ever waiting for another:
  window (1 launch, `_top_digit_window_kernel`, when `window` / WINDOW_PASS is set): round 0's digit from the
      few top digits at and below each chunk's largest one (four packed counts, no histogram), when those hold
      the k-th key; round 0 then returns at once;
  round r (4 launches): each program counts digit r of its chunk's keys whose higher digits equal the prefix
      chosen so far into the row's global histogram: a ballot histogram (`tl.histogram`, 256 bins) when many
      keys match, one relaxed atomic per matching key when at most CHUNK / 16 do (sm_90 SASS: ~50 of a key's
      ~80 instructions are the ballot histogram's; rounds >= 2 match ~1% of the model's keys), nothing when
      none does. Then it takes a ticket on the row's arrival counter (`_arrive_last`); the last program to
      arrive (its ticket says all the others' atomics are in) picks the digit from the 256-bin suffix sums
      and writes the row's state (prefix, need, shift, done), once, for the next launch. No program waits for
      another (no barrier between programs: deadlock-free under PDL, on a side stream, in a graph), and the
      last program puts the counter back to 0. A round whose chosen bucket is taken whole (`need` equals its
      count: on the model's rows the 24-bit bucket of the k-th key usually holds that key alone) ends the
      search: the later rounds' programs read the state and return before reading a score;
  count: after the rounds the prefix is the k-th largest score's key T (or its resolved top bits) and `need`
      says how many keys equal to T are taken; each chunk counts its keys above T and equal to T, and the
      row's last program to arrive writes every chunk's exclusive prefix of both over the earlier chunks;
  write: each chunk reads its four counts and writes its slots in position order (ties in position order),
      so the output equals the one-program kernel's, bit for bit. A chunk that selects nothing reads no
      score; a chunk whose ties are all taken or none (every chunk when the search ended on a whole bucket)
      ranks only its selection, not its ties. From LATE_SLOTS_ROWS rows (every prefill) it writes key
      positions and `_positions_to_slots_kernel` maps them to slots after (one more launch over [rows, k]):
      the write then does no page-table division or gather for the keys it does not select.
Before this design every program re-derived the prefix from the earlier rounds' histograms (R 256-bin scans:
~110 sm_90 instructions and 14 barriers a round, ~440 in the count and write kernels) and the write kernel
summed the earlier chunks' counts itself: 1.4x slower at decode rows, ~2x at prefill slices (H200, CUDA graph; the
A/B ran bench/long_select_v0.py of commit ebc515b: bench/RESULTS.md, thirteenth session). bench/bench_long_select.py
times this design; bench/offline_long_select.py counts its sm_90 instructions offline.
Rows whose token sees at most k keys take them all and read no score (the scores kernel skipped them); chunks past
a token's position return at once. Six launches (+ a memset of the histograms and state), each a pass over the row's
causal prefix in L2; with the window pass (the default) seven; with late slots one more, over the output only.
Decode's 1-2 rows take one launch instead (`triton_indexer_coop`: the same passes with a barrier among a row's
programs between them).
One compiled variant per chunk size (and round), whatever the row length and the page table: a prefill's rows are
as long as its context and its page table as wide as its longest request, so the chunk count and the page-table
stride are not specialised and the count kernel's last program scans the chunks' counts PREFIX_BLOCK at a time (a
block sized by the chunk count compiled a variant per power of two of it: the H200's bench compiled one after Up
for a 131072-token chunk). tests/kernels/test_select_variants.py compiles them offline to check.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_indexer import _rank_2d, page_slots
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args
from dsaserve.kernels.variants import SELECT_CHUNK

CHUNK = SELECT_CHUNK  # keys per program: 16 per thread at 8 warps (decode at 1-2 rows: variants.long_select_chunk)
ROUNDS = 4  # 8-bit digits of the 32-bit order key
DIGITS = tl.constexpr(ROUNDS)  # the same, for the kernels
# round 0's ROUND behind the window pass (its digit is ROUND % ROUNDS = 0): it returns where the pass chose the
# digit. A variant of its own, so round 0 without the pass reads no flag before its scores
AFTER_WINDOW = ROUNDS
BINS = tl.constexpr(256)
STATE = tl.constexpr(1024)  # a row's workspace: 4 rounds' histograms (ROUNDS x BINS int32), then its search state
WS_ROW = tl.constexpr(1040)  # state: prefix, need, shift, done, arrivals, window top, window done (int32; 64-byte rows)
PREFIX_BLOCK = tl.constexpr(128)  # chunk counts the count kernel's last program scans a step
# the window pass before round 0 (`_top_digit_window_kernel`), on since its H200 A/B (2026-12-02, bench/RESULTS.md):
# 2048 x 131072 keys 3,451 -> 2,974 us a replay (round 0's 1,202 us -> the pass's 560 + 161), 128 x 131072
# 236 -> 206, one row even; every output equal to the select without it
WINDOW_PASS = True
# rows from which the write kernel stores key positions and one more launch maps them to slots: the write's
# per-key page-table division and gather for every key, selected or not, were ~30 % of its sm_90 instructions
# (16 keys a thread, common path 1,136 -> 804; 1,327 before its whole-chunk path). H200 (2026-12-02): the write
# at 2048 x 131072 keys 953 -> 610 us + 20 for the mapping; a decode batch of a few rows keeps one launch fewer
LATE_SLOTS_ROWS = 64
SLOT_BLOCK = 1024  # keys a conversion program maps
WINDOW = tl.constexpr(4)  # top digits the window pass counts a chunk (4 x 16-bit counts in an int64: CHUNK < 2^16)
WINDOW_TOP, WINDOW_DONE = tl.constexpr(5), tl.constexpr(6)  # state: the row's largest top digit, round 0 done


@triton.jit
def _ukey(x):
    """float32 -> uint32 with the same order as `_order_key32` + 2^31 (-0.0 is +0.0): negative floats flip every
    bit, the others the sign bit; 32-bit shifts and compares, not int64's."""
    b = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _load_chunk(ptrs, j, lim, c, CHUNK: tl.constexpr):
    """(visible: j <= lim, scores) of a chunk: a chunk visible whole (all but a row's last) loads unmasked,
    so 16-byte vectors and no per-key mask (sm_90 SASS: 4x fewer loads)."""
    vis = j <= lim
    if c * CHUNK + CHUNK - 1 <= lim:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=vis, other=float("-inf"))
    return vis, x


@triton.jit
def _chunk_keys(row_ptr, c, lim, CHUNK: tl.constexpr):
    """(visible, unsigned order key (uint32)) of chunk c of a score row whose keys 0..lim are visible."""
    j = c * CHUNK + tl.arange(0, CHUNK)
    vis, x = _load_chunk(row_ptr + j, j, lim, c, CHUNK)
    return vis, _ukey(x)


@triton.jit
def _last_visible(pos, n_cols):
    """The last key a token sees (int32: its chunk compares cost one instruction a key, not int64's two)."""
    return tl.minimum(pos, n_cols - 1).to(tl.int32)


@triton.jit
def _arrive_last(state, pos, n_chunks, CHUNK: tl.constexpr):
    """Whether this program is the last of its row to arrive (a ticket on the row's arrival counter). Every
    program of the row that reaches this (all chunks at or before the token's position) takes one ticket, and
    none waits for another. The barrier orders this program's global writes and atomics before its ticket
    (acq_rel: release), and the last ticket's acquire orders the others' writes before what its program reads
    next (from L2: .cg). The last program puts the counter back to 0: the next launch (or graph replay) finds
    it there."""
    tl.debug_barrier()
    ticket = tl.atomic_add(state + 4, 1, sem="acq_rel")
    last = ticket == tl.minimum(pos // CHUNK, n_chunks - 1)
    return last


@triton.jit
def _program(pos_ptr, ws_ptr, k, CHUNK: tl.constexpr):
    """(row, chunk, the row's token position, its workspace row, idle): an idle program's token takes every key
    or its chunk lies past the position, so it reads nothing and takes no arrival ticket."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    pos = tl.load(pos_ptr + row)
    return row, c, pos, ws_ptr + row * WS_ROW, (pos < k) | (c * CHUNK > pos)


@triton.jit
def _count_digit(hist, u, vis, prefix, lim, c, D: tl.constexpr, CHUNK: tl.constexpr):
    """Add digit D of the chunk's visible keys whose higher digits equal `prefix` to the row's histogram `hist`."""
    if D == 0:  # every visible key matches the empty prefix: counted without a reduction
        match = vis
        n_match = tl.minimum(lim + 1 - c * CHUNK, CHUNK)
    else:
        match = vis & ((u >> (32 - 8 * D)) == prefix)
        n_match = tl.sum(match.to(tl.int32), axis=0)
    digit = ((u >> (24 - 8 * D)) & 255).to(tl.int32)
    if n_match > CHUNK // 16:  # many keys in the bucket (rounds 0 and 1 on the model's rows): a ballot histogram
        h = tl.histogram(digit, BINS, mask=match)
        tl.atomic_add(hist + tl.arange(0, BINS), h, mask=h > 0, sem="relaxed")
    elif n_match > 0:  # few (later rounds: ~1% of the keys): one atomic each, ~20x fewer instructions
        tl.atomic_add(hist + digit, 1, mask=match, sem="relaxed")


@triton.jit
def _choose_digit(hist, need):
    """(the digit of the k-th key among the matching ones, keys still needed at it, whether its bucket is taken
    whole) from the row's complete 256-bin histogram (read from L2)."""
    d, new_need, resolved, _ = _choose_from(tl.load(hist + tl.arange(0, BINS), cache_modifier=".cg"), need)
    return d, new_need, resolved


@triton.jit
def _choose_from(h, need):
    """`_choose_digit`'s three and the chosen bin's count (the keys the next round counts) from a complete 256-bin
    histogram held in registers (counts < 2^24), 1 <= need <= its total. One scan and one reduction: the digit is
    the one bin b with at_or_above[b] >= need > at_or_above[b + 1] (at_or_above falls from the total to 0), its
    number, at_or_above and count packed in one int64 sum (each block-wide reduction a shared-memory round trip
    and barriers: the choice took five and a scan)."""
    b = tl.arange(0, BINS)
    at_or_above = tl.cumsum(h, axis=0, reverse=True)
    here = (at_or_above >= need) & (at_or_above - h < need)
    packed = tl.sum(tl.where(here, (b.to(tl.int64) << 48) | (at_or_above.to(tl.int64) << 24) | h, 0), axis=0)
    count = (packed & 0xFFFFFF).to(tl.int32)
    new_need = need - ((packed >> 24) & 0xFFFFFF).to(tl.int32) + count
    return (packed >> 48).to(tl.int32), new_need, new_need == count, count


@triton.jit(do_not_specialize=["n_chunks"])
def _radix_round_kernel(score_ptr, pos_ptr, ws_ptr, n_cols, k, stride_s, n_chunks, ROUND: tl.constexpr,
                        CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    D: tl.constexpr = ROUND % 4  # the digit (ROUND 4 = AFTER_WINDOW: round 0 behind the window pass)
    grid_dependency_sync(PDL)
    row, c, pos, ws, idle = _program(pos_ptr, ws_ptr, k, CHUNK)
    if idle:
        return
    state = ws + STATE
    if D == 0:
        prefix = tl.zeros([], dtype=tl.uint32)
        need = tl.zeros([], dtype=tl.int32) + k
        done = need < 0  # False
        if ROUND == 4:  # AFTER_WINDOW: the window pass may have chosen the top digit (every program reads its flag)
            done = tl.load(state + WINDOW_DONE) != 0
    else:
        prefix = tl.load(state).to(tl.uint32, bitcast=True)
        need = tl.load(state + 1)
        done = tl.load(state + 3) != 0
    if done:  # the k-th key's bucket was taken whole: no more digits needed (scores read by none)
        return
    # past here every program of the row takes its ticket (`_arrive_last`): a return added before it would leave
    # the row's last ticket undrawn, its state unwritten and its counter not reset for the next launch
    lim = _last_visible(pos, n_cols)
    vis, u = _chunk_keys(score_ptr + row * stride_s, c, lim, CHUNK)
    hist = ws + D * BINS
    _count_digit(hist, u, vis, prefix, lim, c, D, CHUNK)
    if _arrive_last(state, pos, n_chunks, CHUNK):  # the row's histogram is complete: choose this round's digit
        d, new_need, resolved = _choose_digit(hist, need)
        tl.store(state, (prefix * 256 + d.to(tl.uint32)).to(tl.int32, bitcast=True))
        tl.store(state + 1, new_need)
        tl.store(state + 2, 24 - 8 * D)
        tl.store(state + 3, resolved.to(tl.int32))
        tl.store(state + 4, 0)


@triton.jit(do_not_specialize=["n_chunks"])
def _top_digit_window_kernel(score_ptr, pos_ptr, ws_ptr, n_cols, k, stride_s, n_chunks, CHUNK: tl.constexpr,
                             PDL: tl.constexpr = False):
    """Round 0 without its histogram where it can: each chunk counts its keys in the WINDOW top digits (bits 31..24)
    at and below its own largest one, four 16-bit counts packed in one int64 sum, and raises the row's largest
    digit g. Bins g - WINDOW + 1 .. g are then exact over the row (a chunk leaves out only keys below its own
    window, which is at or below g's), so when they hold >= k keys the row's last program picks round 0's digit
    from them, as round 0 would, and marks the row (round 0 returns at once); otherwise it clears the bins and
    round 0 runs as before. On randn rows round 0's ballot histogram is ~55 % of its time (H200: 1,121 µs against
    round 1's 502 at 2048 x 131072, bench/RESULTS.md, fourteenth session): every key goes through it."""
    grid_dependency_sync(PDL)
    row, c, pos, ws, idle = _program(pos_ptr, ws_ptr, k, CHUNK)
    if idle:
        return
    state = ws + STATE
    vis, u = _chunk_keys(score_ptr + row * stride_s, c, _last_visible(pos, n_cols), CHUNK)
    digit = (u >> 24).to(tl.int32)
    top = tl.max(tl.where(vis, digit, -1), axis=0)  # >= 0: a chunk at or before the position sees a key
    rel = top - digit
    win = vis & (rel < WINDOW)
    one_at = tl.full([CHUNK], 1, tl.int64) << (16 * tl.minimum(rel, WINDOW - 1)).to(tl.int64)  # count i at bits 16i
    packed = tl.sum(tl.where(win, one_at, 0), axis=0)
    for i in tl.static_range(WINDOW):
        n_i = ((packed >> (16 * i)) & 0xFFFF).to(tl.int32)
        if (n_i > 0) & (top >= i):
            tl.atomic_add(ws + top - i, n_i, sem="relaxed")
    tl.atomic_max(state + WINDOW_TOP, top, sem="relaxed")
    if _arrive_last(state, pos, n_chunks, CHUNK):
        g = tl.load(state + WINDOW_TOP, cache_modifier=".cg")
        b = tl.arange(0, BINS)
        h = tl.where(b > g - WINDOW, tl.load(ws + b, cache_modifier=".cg"), 0)
        if tl.sum(h, axis=0) >= k:  # the k-th key's digit is inside the exact bins: round 0's choice
            at_or_above = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
            d = tl.sum((at_or_above >= k).to(tl.int32), axis=0) - 1
            new_need = k - tl.sum(tl.where(b > d, h, 0), axis=0)
            tl.store(state, d)
            tl.store(state + 1, new_need)
            tl.store(state + 2, 24)
            tl.store(state + 3, (new_need == tl.sum(tl.where(b == d, h, 0), axis=0)).to(tl.int32))
            tl.store(state + WINDOW_DONE, 1)
        else:  # round 0 counts every key into the cleared bins
            tl.store(ws + b, tl.zeros([BINS], dtype=tl.int32))
        tl.store(state + 4, 0)


@triton.jit
def _threshold(ws):
    """(the k-th key's prefix T, keys equal to T to take, the shift T is compared at) from the rounds' state."""
    state = ws + STATE
    return tl.load(state).to(tl.uint32, bitcast=True), tl.load(state + 1), tl.load(state + 2)


@triton.jit(do_not_specialize=["n_chunks"])
def _chunk_count_kernel(score_ptr, pos_ptr, ws_ptr, cnt_ptr, n_cols, k, stride_s, n_chunks,
                        CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """cnt[row, c] = (keys above the k-th key T, keys equal to T, the same summed over the chunks before c) in
    chunk c; the sums written by the row's last program to arrive."""
    grid_dependency_sync(PDL)
    row, c, pos, ws, idle = _program(pos_ptr, ws_ptr, k, CHUNK)
    if idle:
        return
    key, _, shift = _threshold(ws)
    vis, u = _chunk_keys(score_ptr + row * stride_s, c, _last_visible(pos, n_cols), CHUNK)
    u = u >> shift  # compared at the resolved digit: a bucket taken whole counts as ties, all needed
    cnt_row = cnt_ptr + row * n_chunks * 4
    tl.store(cnt_row + c * 4, tl.sum((vis & (u > key)).to(tl.int32), axis=0))
    tl.store(cnt_row + c * 4 + 1, tl.sum((vis & (u == key)).to(tl.int32), axis=0))
    if _arrive_last(ws + STATE, pos, n_chunks, CHUNK):  # every chunk's counts are in: exclusive prefix sums
        n_active = tl.minimum(pos // CHUNK, n_chunks - 1) + 1
        above = tl.zeros([], dtype=tl.int32)
        ties = tl.zeros([], dtype=tl.int32)
        for q0 in range(0, n_active, PREFIX_BLOCK):
            q = q0 + tl.arange(0, PREFIX_BLOCK)
            m = q < n_active
            a = tl.load(cnt_row + q * 4, mask=m, other=0, cache_modifier=".cg")
            t = tl.load(cnt_row + q * 4 + 1, mask=m, other=0, cache_modifier=".cg")
            tl.store(cnt_row + q * 4 + 2, above + tl.cumsum(a, axis=0) - a, mask=m)
            tl.store(cnt_row + q * 4 + 3, ties + tl.cumsum(t, axis=0) - t, mask=m)
            above += tl.sum(a, axis=0)
            ties += tl.sum(t, axis=0)
        tl.store(ws + STATE + 4, 0)


@triton.jit
def _write_all_visible(pt_row, out_row, c, n_chunks, pos, k, page_size, CHUNK: tl.constexpr):
    """A token that sees at most k keys: chunk c's columns of [slots of keys 0..pos, -1, ...] (k columns, which can
    pass the row's n_chunks x CHUNK: the grid's chunks then take them in turns)."""
    for c0 in range(c * CHUNK, k, n_chunks * CHUNK):
        j = c0 + tl.arange(0, CHUNK)
        tl.store(out_row + j, tl.where(j <= pos, page_slots(pt_row, j, page_size, j <= pos), -1), mask=j < k)


@triton.jit
def _write_chunk(out_at, pt_row, page_size, j, above, eq, taken, ties, SLOTS: tl.constexpr):
    """Store a chunk's selected keys (every key above T; its ties at T: all, none, or the first `taken` in
    position order) at out_at + their rank in the chunk's selection: physical slots, or positions (SLOTS off)."""
    sel = above | (eq & (taken > 0))
    if (taken > 0) & (taken < ties):  # the chunk holds the last tie taken: rank its ties in position order
        sel = above | (eq & (_rank_2d(eq.to(tl.int32)) <= taken))
    sel = sel.to(tl.int32)
    what = page_slots(pt_row, j, page_size, sel == 1) if SLOTS else j
    tl.store(out_at + _rank_2d(sel), what, mask=sel == 1)


@triton.jit
def _writer(pos_ptr, pt_ptr, req_ptr, out_ptr, stride_pt, stride_o):
    """(row, chunk, the row's token position, its request's page-table row, its output row) of a writing program."""
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row)
    pt_row = pt_ptr + tl.load(req_ptr + row).to(tl.int64) * stride_pt
    return row, tl.program_id(1), pos, pt_row, out_ptr + row * stride_o


@triton.jit
def _writer_role(pos_ptr, pt_ptr, req_ptr, out_ptr, stride_pt, stride_o, n_chunks, k, page_size,
                 CHUNK: tl.constexpr):
    """`_writer`'s (row, chunk, position, page-table row, output row) and whether this program selects: a token that
    sees at most k keys has its chunk's columns of every visible key written here (`_write_all_visible`); a chunk
    past the position has nothing to do."""
    row, c, pos, pt_row, out_row = _writer(pos_ptr, pt_ptr, req_ptr, out_ptr, stride_pt, stride_o)
    if pos < k:
        _write_all_visible(pt_row, out_row, c, n_chunks, pos, k, page_size, CHUNK)
    return row, c, pos, pt_row, out_row, (pos >= k) & (c * CHUNK <= pos)


@triton.jit(do_not_specialize=["stride_pt", "n_chunks"])
def _chunk_write_kernel(score_ptr, pt_ptr, req_ptr, pos_ptr, ws_ptr, cnt_ptr, out_ptr, n_cols, k, page_size,
                        stride_s, stride_pt, stride_o, n_chunks, CHUNK: tl.constexpr, SLOTS: tl.constexpr = True,
                        PDL: tl.constexpr = False):
    """Chunk c's selected keys -> physical slots (SLOTS; else key positions, `_positions_to_slots_kernel` maps
    them after) at their rank among the row's selection (position order): every key above T, then the ties at T
    in position order until `need` are taken. A chunk visible whole (all but a row's last) takes a path without
    the visibility mask: sm_90 SASS, 16 keys a thread, its masks no longer spill from the predicate registers."""
    grid_dependency_sync(PDL)
    row, c, pos, pt_row, out_row, active = _writer_role(pos_ptr, pt_ptr, req_ptr, out_ptr, stride_pt, stride_o,
                                                        n_chunks, k, page_size, CHUNK)
    if active:
        key, need, shift = _threshold(ws_ptr + row * WS_ROW)
        cnt = cnt_ptr + (row * n_chunks + c) * 4
        above, ties, above_before, ties_before = tl.load(cnt), tl.load(cnt + 1), tl.load(cnt + 2), tl.load(cnt + 3)
        _write_selected(score_ptr + row * stride_s, pt_row, out_row, c, pos, n_cols, page_size, key, need, shift,
                        above, ties, above_before, ties_before, CHUNK, SLOTS)


@triton.jit
def _write_selected(row_ptr, pt_row, out_row, c, pos, n_cols, page_size, key, need, shift, above, ties, above_before,
                    ties_before, CHUNK: tl.constexpr, SLOTS: tl.constexpr):
    """Chunk c's part of the row's selection, given the threshold (key, need, shift) and the chunk's counts (keys
    above T and at T in it and in the chunks before it): its scores read again from L2 in [CHUNK / 128, 128]."""
    taken = tl.minimum(tl.maximum(need - ties_before, 0), ties)  # this chunk's ties that are taken
    if above + taken > 0:  # a chunk that selects nothing reads no score
        C: tl.constexpr = 128
        j = c * CHUNK + (tl.arange(0, CHUNK // C) * C)[:, None] + tl.arange(0, C)[None, :]
        ptrs = row_ptr + j
        out_at = out_row + above_before + tl.minimum(need, ties_before) - 1
        lim = _last_visible(pos, n_cols)
        if c * CHUNK + CHUNK - 1 <= lim:
            u = _ukey(tl.load(ptrs)) >> shift
            _write_chunk(out_at, pt_row, page_size, j, u > key, u == key, taken, ties, SLOTS)
        else:
            vis = j <= lim
            u = _ukey(tl.load(ptrs, mask=vis, other=float("-inf"))) >> shift
            _write_chunk(out_at, pt_row, page_size, j, vis & (u > key), vis & (u == key), taken, ties, SLOTS)


@triton.jit(do_not_specialize=["stride_pt"])
def _positions_to_slots_kernel(pt_ptr, req_ptr, pos_ptr, out_ptr, k, page_size, stride_pt, stride_o,
                               BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[row, :k] <- the physical slots of the key positions the write kernel (SLOTS off) put there; a row whose
    token sees at most k keys holds slots already (`_write_all_visible`)."""
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row)
    if pos < k:
        return
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    at = out_ptr + row * stride_o + j
    keys = tl.load(at, mask=j < k, other=-1)
    valid = (keys >= 0) & (keys <= pos)  # always, when the write kept its precondition: never a wild page index
    pt_row = pt_ptr + tl.load(req_ptr + row).to(tl.int64) * stride_pt
    tl.store(at, tl.where(valid, page_slots(pt_row, keys.to(tl.int32), page_size, valid), -1), mask=j < k)


def long_row_select(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor,
                    positions: torch.Tensor, out: torch.Tensor, k: int, page_size: int, chunk: int = CHUNK,
                    window: bool = WINDOW_PASS, late_slots: bool | None = None) -> None:
    """out [rows, >= k] (int64) <- the k largest causal scores' physical slots per row, in position order,
    -1 padded for tokens that see fewer than k keys. scores [rows, n_cols] fp32 (rows of tokens whose
    position is below k may be unwritten: they are not read). No host sync: capturable in a CUDA graph.
    window: launch the window pass before round 0; late_slots: see `launches` (the output is the same).
    Decode's 1-2 rows take `triton_indexer_coop` instead (one launch: `coop_select`, or over the FP8 cache with
    their scores, `coop_score_select`)."""
    for kernel, grid, args, kwargs in launches(scores, page_table, req_index, positions, out, k, page_size, chunk,
                                               window, late_slots):
        kernel[grid](*args, **kwargs)


def workspace(scores: torch.Tensor, chunk: int, zeroed: torch.Tensor | None = None,
              with_counts: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, int], dict]:
    """(the rows' zeroed workspace: histograms, state, counters; the chunks' counts, None without with_counts; the
    grid (rows, chunks); the launch keywords) of a select over `scores` in `chunk`-key chunks, the chunk checked.
    zeroed: a workspace of >= rows rows known to be zero (`triton_indexer_coop.coop_workspace`), else one is made
    (a fill launch)."""
    if chunk < 128 or chunk > 1 << 15 or chunk & (chunk - 1):  # the window pass packs counts <= CHUNK in 16 bits
        raise ValueError(f"long_row_select: chunk {chunk} is not a power of two in [128, 32768]")
    rows, n_chunks = scores.shape[0], triton.cdiv(scores.shape[1], chunk)
    ws = zeroed[:rows] if zeroed is not None else torch.zeros((rows, WS_ROW.value), dtype=torch.int32,
                                                                device=scores.device)
    counts = torch.empty((rows, n_chunks, 4), dtype=torch.int32, device=scores.device) if with_counts else None
    # 16 keys a thread (4096-key chunks: 8 warps), 4..16 warps
    return ws, counts, (rows, n_chunks), {"CHUNK": chunk, "num_warps": min(16, max(4, chunk // 512)),
                                          **pdl_args(scores.device)}


def launches(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
             out: torch.Tensor, k: int, page_size: int, chunk: int = CHUNK, window: bool = WINDOW_PASS,
             late_slots: bool | None = None) -> list[tuple]:
    """`long_row_select`'s launches in order, as (kernel, grid, arguments, keywords), its workspaces allocated and
    zeroed here (so the list runs once: a second run would add to the first's histograms), tests compile them
    offline: one variant per chunk size, whatever the row length or page-table width. A token at position
    >= k must see k keys (positions < n_cols, as every caller's are). late_slots: the write stores positions and
    a last launch maps them to slots (default: from LATE_SLOTS_ROWS rows)."""
    rows, n_cols = scores.shape
    if rows == 0:
        return []
    ws, counts, grid, launch = workspace(scores, chunk)
    n_chunks = grid[1]
    select = (scores, positions, ws, n_cols, k, scores.stride(0), n_chunks)
    late_slots = rows >= LATE_SLOTS_ROWS if late_slots is None else late_slots
    return [*([(_top_digit_window_kernel, grid, select, launch)] if window else []),
            *((_radix_round_kernel, grid, select, {"ROUND": AFTER_WINDOW if window and r == 0 else r, **launch})
              for r in range(ROUNDS)),
            (_chunk_count_kernel, grid, (scores, positions, ws, counts, n_cols, k, scores.stride(0), n_chunks),
             launch),
            (_chunk_write_kernel, grid, (scores, page_table, req_index, positions, ws, counts, out, n_cols, k,
                                         page_size, scores.stride(0), page_table.stride(0), out.stride(0), n_chunks),
             {"SLOTS": not late_slots, **launch}),
            *([(_positions_to_slots_kernel, (rows, triton.cdiv(k, SLOT_BLOCK)),
                (page_table, req_index, positions, out, k, page_size, page_table.stride(0), out.stride(0)),
                {"BLOCK": SLOT_BLOCK, "num_warps": 4, **pdl_args(scores.device)})] if late_slots else [])]
