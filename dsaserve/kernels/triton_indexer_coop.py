"""The long-row decode selection of a few rows in one launch (request path stage 6, full indexer layers).

Owns: `coop_select`, the same top-k as `triton_indexer_long.long_row_select` (its radix rounds, count and write,
bit for bit) as one `_coop_select_kernel` launch: a barrier among a row's programs stands where the launches had a
launch boundary, every program keeps its chunk's keys in registers and chooses each round's digit itself from the
row's complete histogram; and `coop_score_select`, the paged score kernel's scores and that select in one
`_coop_score_select_kernel` launch over the page-major FP8 cache (each program scores its own chunk, then selects
over it). `cooperative` and `fused` are decode's choices (`triton_indexer_dispatch`): 1-2 rows where every program
can be resident at once, fused up to FUSED_MAX_CHUNK-key chunks. Both work in `coop_workspace`, one shared buffer
their programs leave ready for the next launch, so no fill launch precedes them. H200, graph-timed
(bench/RESULTS.md): the select, one row of 32K keys 16.7 -> 12.4 us, of 128K 20.5-23.1 -> 15.7-17.8; two rows
17.4-19.5 -> 12.8-14.6 and 22.8-24.1 -> 18.1-19.3 (nineteenth session); scores + select fused, one row of 32K keys
21.0-21.4 -> 17.1-17.5 us, two rows 26.5-26.8 -> 22.7-23.0 (twenty-second session; in the batch-1 step inside the
machine's spread: the side stream's few microseconds a full layer are mostly hidden behind the q path at 32K).
A radix round needs no barrier (`HIST_POLL`): each program polls the round's histogram until its bins sum to the keys
the round counts, then chooses the digit from what it read; nor does the count (`COUNT_POLL`): each program polls
the earlier chunks' tagged count words. Where a program's time goes, phase by phase: bench/probe_select_phases.py
(the kernels' STAMPS).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels.triton_fp8_gemm import _sm_count
from dsaserve.kernels.triton_indexer import page_slots
from dsaserve.kernels.triton_indexer_long import (
    BINS,
    DIGITS,
    PREFIX_BLOCK,
    STATE,
    WS_ROW,
    _choose_digit,
    _choose_from,
    _chunk_keys,
    _count_digit,
    _last_visible,
    _ukey,
    _write_selected,
    _writer_role,
    workspace,
)
from dsaserve.kernels.triton_indexer_paged import (
    DEFAULT_TILE,
    chunk_scores,
    q_meta,
    q_rows,
    rounded_q,
    score_tiles,
)
from dsaserve.kernels.triton_utils import INTERPRET, grid_dependency_sync, made_once
from dsaserve.kernels.variants import FEW_ROWS, FUSED_MAX_CHUNK

COOP_BARRIERS = tl.constexpr(8)  # a row's state: the ROUNDS + 1 barrier counters (state 8..12, after the launches')
COOP_EXIT = tl.constexpr(13)  # and the count of programs past the last barrier (`_leave_zeroed`)
COOP_PARITY = tl.constexpr(14)  # and which of the row's two count buffers this launch's programs fill (COUNT_POLL)
COOP_MAX_CHUNKS = tl.constexpr(256)  # a row's programs at most (one an SM: `coop_fits`)
# chunks below this many keys: a chunk's two counts (above, ties) share one int32 sum (one block-wide reduction,
# not two), 16 bits each; `long_row_select`'s launches take chunks up to 32768
COOP_CHUNK_LIMIT = tl.constexpr(1 << 15)
COOP_COUNTS = WS_ROW  # then the two count buffers: COOP_MAX_CHUNKS int64 words each (COUNT_POLL)
COOP_WS_ROW = tl.constexpr(WS_ROW.value + 2 * 2 * COOP_MAX_CHUNKS.value)  # int32 (8256 bytes: 64-byte rows)
# a chunk's count word: (keys above T) << 32 | (ties at T) | COUNT_IN, so a zero word is one not yet written
COUNT_IN = tl.constexpr(1 << 62)
COOP_WS_ROWS = FEW_ROWS  # the rows of `coop_workspace`: decode's 1-2 rows (the decode graphs' few-row classes too)
# decode rows up to which one cooperative launch replaces the select's launches (`cooperative`; not under the
# interpreter: it runs a launch's programs one after another, so a barrier among them would never open)
COOP_ROWS = 0 if INTERPRET else COOP_WS_ROWS
# decode rows up to which the FP8 cache's scores and select are that one launch (`fused`); 0: the score kernel, then
# the cooperative select (the A/B's "score_apart")
FUSED_ROWS = COOP_ROWS
# every cooperative launch takes the shared workspace its programs leave zero (False: a zeroed one of its own,
# a fill launch before each; bench/profile_decode.py's "select_fill")
SHARED_WORKSPACE = True
# each round's histogram polled until its bins sum to the keys that round counts (round 0: the row's visible keys;
# round r: the bucket round r - 1 chose), then the digit chosen from the bins the poll read: no arrival counter, no
# acquire, no second read of the histogram. Bins only grow, so a read whose sum is the total read every bin's
# final count. (False: a barrier among the row's programs, then the histogram read; `profile_decode --ab
# coop_barriers`.) The count keeps its barrier: its chunks' counts are stored, not summed. H100, three machines, in
# the step (bench/RESULTS.md, fifty-fourth session): b1 32K -4.5 to -7 µs, 128K -5 to -6.5 against the barriers,
# though alone the selection is ~0.5 µs slower (round 1's atomics land slower under 128 pollers)
HIST_POLL = True
# the chunks' counts exchanged as tagged words, each program polling only the words of the chunks before it (whose
# keys it ranks after), not behind a barrier among all the row's programs; the row's last program zeroes the
# histograms once every word is in, and nothing is left to count programs out (`_leave_zeroed`'s read-modify-write
# a program). The words live in two buffers a row, the launches taking them in turn (`COOP_PARITY`): a launch's
# first program zeroes the buffer the next launch fills, which the previous launch filled and finished reading.
# (False: a barrier, then the earlier chunks' counts read, then `_leave_zeroed`; `profile_decode --ab
# coop_count_barrier`.)
COUNT_POLL = True
# the fused launch's scores kept in registers, its keys asked of memory before the token's q is rounded and q asked
# for beside the program's role (`triton_indexer_paged.chunk_scores`), in chunks up to KEYS_FIRST_MAX_CHUNK keys;
# else q loaded and rounded, then the keys tile by tile through the score buffer (`score_tiles`), read back by the
# select (`profile_decode --ab coop_q_first_off`). H100 (bench/RESULTS.md, fifty-fifth session): b1 32K (256-key
# chunks) -3.6 µs a step, the selection alone 13.68 -> 12.84 µs; at 64K (512-key chunks: 120 registers) no gain in
# the step, so those keep the tiles; 2048-key chunks in registers did not give the tiles' scores bit for bit
KEYS_FIRST = True
KEYS_FIRST_MAX_CHUNK = 256
_COOP_WS: dict[tuple[str, int | None], torch.Tensor] = {}


@triton.jit
def _row_barrier(counter, n_active):
    """Wait until the row's n_active programs have all arrived at this counter (zero when the launch starts). The CTA
    barrier and the release order every thread's earlier global writes and atomics before the arrival; the
    acquire orders the others' before what follows. Only for launches whose programs are all resident together
    (`_coop_select_kernel`, `_coop_score_select_kernel`)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter, 1, sem="release") + 1
    while arrived < n_active:  # polled with plain L2 reads (not read-modify-writes on the one address)
        arrived = tl.load(counter, volatile=True)
    tl.atomic_add(counter, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _complete_histogram(hist, total):
    """The row's 256-bin histogram once its bins sum to `total` (every program's counts landed: `HIST_POLL`). (A
    sleep of 100 or 400 ns between reads, so the pollers' rereads load the L2 lines less while the atomics land:
    no faster, H100, bench/RESULTS.md fifty-fourth session.)"""
    b = tl.arange(0, BINS)
    h = tl.load(hist + b, volatile=True)
    while tl.sum(h, axis=0) < total:
        h = tl.load(hist + b, volatile=True)
    return h


@triton.jit
def _zero_rounds(ws, BARRIERS: tl.constexpr):
    """The row's round histograms zeroed, and with BARRIERS the rounds' barrier counters (not the count's)."""
    tl.store(ws + tl.arange(0, DIGITS * BINS), tl.zeros([DIGITS * BINS], dtype=tl.int32))
    if BARRIERS:
        rounds = tl.arange(0, 8)
        tl.store(ws + STATE + COOP_BARRIERS + rounds, tl.zeros([8], dtype=tl.int32), mask=rounds < DIGITS)


@triton.jit
def _leave_zeroed(ws, c, n_active):
    """Leave the row's workspace zero, as the launch found it (`coop_workspace`: no fill launch before the next).
    Past the last barrier no program reads the histograms or the round barriers again, so the row's first program
    zeroes them; the last barrier's counter is zeroed by the last program past it (a count of programs past it:
    only that one knows that none still polls the counter)."""
    if c == 0:
        _zero_rounds(ws, True)
    past = tl.atomic_add(ws + STATE + COOP_EXIT, 1, sem="acq_rel") + 1
    if past == n_active:
        tl.store(ws + STATE + COOP_BARRIERS + DIGITS, 0)
        tl.store(ws + STATE + COOP_EXIT, 0)


@triton.jit
def _count_buffer(ws, parity):
    """The row's count buffer `parity` (COOP_MAX_CHUNKS int64 words)."""
    return (ws + COOP_COUNTS).to(tl.pointer_type(tl.int64)) + parity * COOP_MAX_CHUNKS


@triton.jit
def _counts_before(words, c):
    """(keys above T, ties at T) in the chunks before chunk c, their words polled until every one is in."""
    q = tl.arange(0, COOP_MAX_CHUNKS)
    w = tl.load(words + q, mask=q < c, other=COUNT_IN, volatile=True)
    while tl.min((w >> 62).to(tl.int32), axis=0) == 0:
        w = tl.load(words + q, mask=q < c, other=COUNT_IN, volatile=True)
    return tl.sum((w >> 32).to(tl.int32) & 0xFFFFF, axis=0), tl.sum(w.to(tl.int32) & 0xFFFFF, axis=0)


@triton.jit
def _exchange_counts(ws, parity, c, n_active, above, ties, POLL: tl.constexpr):
    """COUNT_POLL: chunk c's counts out as a tagged word, the earlier chunks' summed in (`_counts_before`). The row's
    last program, once every word is in (so every program is past its rounds), zeroes the histograms (and the
    rounds' barrier counters where they ran: not POLL) and hands the next launch the other buffer, which the first
    program zeroes: its readers were the previous launch's."""
    words = _count_buffer(ws, parity)
    tl.store(words + c, COUNT_IN | (above.to(tl.int64) << 32) | ties.to(tl.int64))
    if c == 0:
        tl.store(_count_buffer(ws, 1 - parity) + tl.arange(0, COOP_MAX_CHUNKS),
                 tl.zeros([COOP_MAX_CHUNKS], dtype=tl.int64))
    above_before, ties_before = _counts_before(words, c)
    if c == n_active - 1:
        _zero_rounds(ws, not POLL)
        tl.store(ws + STATE + COOP_PARITY, 1 - parity)
    return above_before, ties_before


@triton.jit
def _counts_at_barrier(ws, cnt_row, c, n_active, above, ties):
    """Not COUNT_POLL: chunk c's counts stored, a barrier among the row's programs, the workspace left zero
    (`_leave_zeroed`), then the earlier chunks' counts read and summed."""
    tl.store(cnt_row + c * 4, above)
    tl.store(cnt_row + c * 4 + 1, ties)
    _row_barrier(ws + STATE + COOP_BARRIERS + DIGITS, n_active)
    _leave_zeroed(ws, c, n_active)
    above_before = tl.zeros([], dtype=tl.int32)
    ties_before = tl.zeros([], dtype=tl.int32)
    for q0 in range(0, c, PREFIX_BLOCK):
        q = q0 + tl.arange(0, PREFIX_BLOCK)
        m = q < c
        above_before += tl.sum(tl.load(cnt_row + q * 4, mask=m, other=0, cache_modifier=".cg"), axis=0)
        ties_before += tl.sum(tl.load(cnt_row + q * 4 + 1, mask=m, other=0, cache_modifier=".cg"), axis=0)
    return above_before, ties_before


@triton.jit
def _write_held(out_row, slots, gt, eq, need, above, ties, above_before, ties_before):
    """`triton_indexer_long._write_selected` from what the program holds (COUNT_POLL): the chunk's keys' compares
    with T and their slots, read before the rounds, not its scores and page-table entries read again after them."""
    taken = tl.minimum(tl.maximum(need - ties_before, 0), ties)  # this chunk's ties that are taken
    if above + taken > 0:
        sel = gt | (eq & (taken > 0))
        if (taken > 0) & (taken < ties):  # the chunk holds the last tie taken: its ties ranked in position order
            sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= taken))
        sel = sel.to(tl.int32)
        out_at = out_row + above_before + tl.minimum(need, ties_before) - 1
        tl.store(out_at + tl.cumsum(sel, axis=0), slots, mask=sel == 1)


@triton.jit
def _stamp(ts, i: tl.constexpr, STAMPS: tl.constexpr):
    """ts [32] int64 with stamp i (the SM's %clock64 at 2i, %globaltimer at 2i + 1) where STAMPS (a bench switch:
    bench/probe_select_phases.py reads where a program's time goes; off, nothing is compiled in)."""
    if STAMPS:
        j = tl.arange(0, 32)
        clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
        ts = tl.where(j == 2 * i, clk, ts)
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                        pack=1)
        ts = tl.where(j == 2 * i + 1, now, ts)
    return ts


@triton.jit
def _select_chunk(vis, u, row_ptr, pt_row, out_row, ws_ptr, cnt_ptr, row, c, pos, n_cols, k, page_size, n_chunks,
                  CHUNK: tl.constexpr, ts, STAMPS: tl.constexpr, POLL: tl.constexpr, COUNT_POLL: tl.constexpr):
    """Chunk c's part of its row's split radix select (`triton_indexer_long`'s rounds, count and write), given its
    keys (visible, order key: `_chunk_keys` of its scores at row_ptr, which only the write without COUNT_POLL reads
    again), with a barrier among the row's programs where the launches had a launch boundary: the chunk's keys kept,
    every program choosing each round's digit itself from the row's complete histogram (the same numbers, so the
    same choice and the same early end); the output equals the launches', bit for bit. POLL: no barrier
    before a round's choice; each program polls the round's histogram until it is complete (`_complete_histogram`).
    COUNT_POLL: no barrier before the write either (`_exchange_counts`), which takes the keys and slots held here."""
    ws = ws_ptr + row * COOP_WS_ROW
    n_active = tl.minimum(pos // CHUNK, n_chunks - 1) + 1
    lim = _last_visible(pos, n_cols)
    if COUNT_POLL:  # read now, used after the rounds
        parity = tl.load(ws + STATE + COOP_PARITY, cache_modifier=".cg")
        slots = page_slots(pt_row, c * CHUNK + tl.arange(0, CHUNK), page_size, vis)
    ts = _stamp(ts, 4, STAMPS)
    prefix = tl.zeros([], dtype=tl.uint32)
    need = tl.zeros([], dtype=tl.int32) + k
    shift = tl.zeros([], dtype=tl.int32)
    done = tl.zeros([], dtype=tl.int32)
    total = lim + 1  # the keys round 0 counts: every visible one (POLL)
    for D in tl.static_range(DIGITS):
        if done == 0:
            _count_digit(ws + D * BINS, u, vis, prefix, lim, c, D, CHUNK)
            ts = _stamp(ts, 5 + 2 * D, STAMPS)
            if POLL:
                h = _complete_histogram(ws + D * BINS, total)
                ts = _stamp(ts, 6 + 2 * D, STAMPS)
                d, need, resolved, total = _choose_from(h, need)  # total: the next round's keys
            else:
                _row_barrier(ws + STATE + COOP_BARRIERS + D, n_active)
                ts = _stamp(ts, 6 + 2 * D, STAMPS)
                d, need, resolved = _choose_digit(ws + D * BINS, need)
            prefix = prefix * 256 + d.to(tl.uint32)
            shift = tl.zeros([], dtype=tl.int32) + (24 - 8 * D)
            done = resolved.to(tl.int32)
    key = u >> shift
    gt = vis & (key > prefix)
    eq = vis & (key == prefix)
    tl.static_assert(CHUNK < COOP_CHUNK_LIMIT)
    both = tl.sum(gt.to(tl.int32) * 65536 + eq.to(tl.int32), axis=0)
    above = both >> 16
    ties = both & 0xFFFF
    ts = _stamp(ts, 13, STAMPS)
    if COUNT_POLL:
        above_before, ties_before = _exchange_counts(ws, parity, c, n_active, above, ties, POLL)
        ts = _stamp(ts, 14, STAMPS)
        _write_held(out_row, slots, gt, eq, need, above, ties, above_before, ties_before)
    else:
        above_before, ties_before = _counts_at_barrier(ws, cnt_ptr + row * n_chunks * 4, c, n_active, above, ties)
        ts = _stamp(ts, 14, STAMPS)
        _write_selected(row_ptr, pt_row, out_row, c, pos, n_cols, page_size, prefix, need, shift, above, ties,
                        above_before, ties_before, CHUNK, True)
    return _stamp(ts, 15, STAMPS)


@triton.jit(do_not_specialize=["stride_pt", "n_chunks"])
def _coop_select_kernel(score_ptr, pt_ptr, req_ptr, pos_ptr, ws_ptr, cnt_ptr, out_ptr, n_cols, k, page_size,
                        stride_s, stride_pt, stride_o, n_chunks, CHUNK: tl.constexpr, PDL: tl.constexpr = False,
                        POLL: tl.constexpr = False, COUNT_POLL: tl.constexpr = False):
    """The split radix select in one launch for a few rows (COOP_ROWS): `_select_chunk` a program.
    Deadlock-free because `coop_select` takes it only for at most one program an SM (rows x chunks <= the SM
    count): each program finds an SM once the kernels beside it end, and none of them waits for this one (on the
    side stream, the select's only consumer joins after it)."""
    grid_dependency_sync(PDL)
    row, c, pos, pt_row, out_row, active = _writer_role(pos_ptr, pt_ptr, req_ptr, out_ptr, stride_pt, stride_o,
                                                        n_chunks, k, page_size, CHUNK)
    if active:  # (a chunk past the position is not one of the row's n_active programs)
        row_ptr = score_ptr + row * stride_s
        vis, u = _chunk_keys(row_ptr, c, _last_visible(pos, n_cols), CHUNK)
        _select_chunk(vis, u, row_ptr, pt_row, out_row, ws_ptr, cnt_ptr, row, c, pos, n_cols, k, page_size,
                      n_chunks, CHUNK, tl.zeros([32], dtype=tl.int64), False, POLL, COUNT_POLL)


@triton.jit(do_not_specialize=["stride_pt", "n_chunks"])
def _coop_score_select_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, score_ptr, pt_ptr, req_ptr, pos_ptr, ws_ptr, cnt_ptr,
                              out_ptr, n_heads, head_dim, n_cols, k, page_size: tl.constexpr, page_bytes, stride_qt,
                              stride_qh, stride_wt, stride_s, stride_pt, stride_o, n_chunks, HP: tl.constexpr,
                              BLOCK_D: tl.constexpr, BS: tl.constexpr, Q_FP8: tl.constexpr, CHUNK: tl.constexpr,
                              PDL: tl.constexpr = False, STAMPS: tl.constexpr = False,
                              POLL: tl.constexpr = False, COUNT_POLL: tl.constexpr = False,
                              KEYS_FIRST: tl.constexpr = False):
    """Scores and select in one launch (`coop_score_select`): each program scores its chunk's visible keys over
    the page-major cache (the decode score kernel's numbers), then runs the chunk's select over them: KEYS_FIRST,
    in registers (`triton_indexer_paged.chunk_scores`), else through the score buffer (`score_tiles`; a program
    reads back only the scores it wrote, the CTA barrier ordering its threads' stores before those loads). STAMPS
    (bench only): each program's phase stamps (`_stamp`) over the first 64 scores of its own chunk at its end."""
    ts = _stamp(tl.zeros([32], dtype=tl.int64), 0, STAMPS)
    grid_dependency_sync(PDL)
    if KEYS_FIRST:  # asked for beside the role's loads (needs only the row: program_id(0))
        q_raw, w_raw = q_rows(q_ptr, w_ptr, tl.program_id(0).to(tl.int64), n_heads, head_dim, stride_qt, stride_qh,
                              stride_wt, HP, BLOCK_D)
    row, c, pos, pt_row, out_row, active = _writer_role(pos_ptr, pt_ptr, req_ptr, out_ptr, stride_pt, stride_o,
                                                        n_chunks, k, page_size, CHUNK)
    ts = _stamp(ts, 1, STAMPS)
    if active:
        row_ptr = score_ptr + row * stride_s
        j0 = c * CHUNK
        end = tl.minimum(pos + 1, n_cols)
        if KEYS_FIRST:
            vis, x = chunk_scores(q_raw, w_raw, k_ptr, ks_ptr, pt_row, j0, end, head_dim, page_size, page_bytes,
                                   BLOCK_D, Q_FP8, CHUNK)
            if not COUNT_POLL:  # that write reads the scores again
                tl.store(row_ptr + j0 + tl.arange(0, CHUNK), x)
                tl.debug_barrier()
            u = _ukey(x)
            ts = _stamp(ts, 3, STAMPS)
        else:
            q, w = rounded_q(q_ptr, w_ptr, row, n_heads, head_dim, stride_qt, stride_qh, stride_wt, HP, BLOCK_D,
                             Q_FP8)
            ts = _stamp(ts, 2, STAMPS)
            score_tiles(q, w, k_ptr, ks_ptr, pt_row, row_ptr, j0, tl.cdiv(tl.minimum(end, j0 + CHUNK) - j0, BS), end,
                        page_size, page_bytes, head_dim, BLOCK_D, BS, Q_FP8)
            tl.debug_barrier()
            ts = _stamp(ts, 3, STAMPS)
            vis, u = _chunk_keys(row_ptr, c, _last_visible(pos, n_cols), CHUNK)
        ts = _select_chunk(vis, u, row_ptr, pt_row, out_row, ws_ptr, cnt_ptr, row, c, pos, n_cols, k, page_size,
                           n_chunks, CHUNK, ts, STAMPS, POLL, COUNT_POLL)
        if STAMPS:
            tl.debug_barrier()  # every thread done reading the chunk's scores
            tl.store((row_ptr + j0).to(tl.pointer_type(tl.int64)) + tl.arange(0, 32), ts)


def coop_workspace(device: torch.device) -> torch.Tensor:
    """[COOP_WS_ROWS, COOP_WS_ROW] int32 whose histograms and barrier counters are zero between launches: every
    cooperative launch leaves them as it found them (`_exchange_counts`, or `_leave_zeroed`), and the count buffer the
    next launch fills zeroed, so none needs a fill launch before it (a torch fill on each full layer's selection path,
    3.6-4.1 us of an H100's batch-1 step at 32K, bench/RESULTS.md thirty-seventh session). Made once per device when
    the registry binds the GPU ops (`triton_utils.made_once`).
    Shared by every cooperative launch. **Invariant: no two cooperative launches of a device run at once.** Today
    they run one after another: a forward's full layers select in turn, on the indexer's side stream (each waiting
    for the compute stream, which joins it before the layer's attention) or on the compute stream itself
    (piecewise segments, no side stream); `forward_hidden` / `forward_mtp` join the side stream at their end; graphs
    replay on one stream; one thread runs forwards. Two batches overlapped on two streams, or a drafter running
    beside its target, would need a workspace each."""
    return made_once(_COOP_WS, (device.type, device.index), device, "coop_workspace",
                     lambda: _fresh_workspace(COOP_WS_ROWS, device))


def ready_for_next_launch(ws: torch.Tensor) -> bool:
    """Whether workspace rows are as every cooperative launch must find them: the histograms, the barrier counters
    and the count buffer the next launch fills (`COOP_PARITY` says which) all zero; the other buffer may hold the
    last launch's count words."""
    words = ws[:, COOP_COUNTS.value:].view(torch.int64).view(ws.shape[0], 2, COOP_MAX_CHUNKS.value)
    parity = ws[:, STATE.value + COOP_PARITY.value].long()
    state = ws[:, :WS_ROW.value].clone()
    state[:, STATE.value + COOP_PARITY.value] = 0
    return not state.any() and not words[torch.arange(ws.shape[0], device=ws.device), parity].any()


def _fresh_workspace(rows: int, device: torch.device) -> torch.Tensor:
    return torch.zeros((rows, COOP_WS_ROW.value), dtype=torch.int32, device=device)


def _zeroed(scores: torch.Tensor) -> torch.Tensor:
    """The launch's workspace rows: the shared ones (`coop_workspace`), or zeroed ones of its own (a fill launch)."""
    if SHARED_WORKSPACE and scores.shape[0] <= COOP_WS_ROWS:
        return coop_workspace(scores.device)
    return _fresh_workspace(scores.shape[0], scores.device)


def coop_fits(rows: int, n_chunks: int, scores: torch.Tensor) -> bool:
    """Whether a cooperative launch of rows x n_chunks programs is safe: one program an SM at most, so each finds an
    SM once the kernels beside it end and all are resident together (a GPU shared through MPS with an SM limit is
    not seen here), and no more programs a row than its count buffers hold."""
    return rows * n_chunks <= _sm_count(scores) and n_chunks <= COOP_MAX_CHUNKS.value


def cooperative(rows: int, n_cols: int, chunk: int, scores: torch.Tensor) -> bool:
    """Decode's choice (`triton_indexer_dispatch`): its 1-2 rows (COOP_ROWS) as one cooperative launch where it fits
    and its chunk is below COOP_CHUNK_LIMIT. A prefill's rows keep the launches (its late slots and window pass; none
    of its kernels runs beside it)."""
    return rows <= COOP_ROWS and chunk < COOP_CHUNK_LIMIT.value and coop_fits(rows, triton.cdiv(n_cols, chunk), scores)


def fused(rows: int, n_cols: int, chunk: int, like: torch.Tensor) -> bool:
    """Decode's choice for 1-2 rows over the page-major FP8 cache: scores and select in one cooperative launch
    (`coop_score_select`) where the cooperative select would be taken and the chunk is at most FUSED_MAX_CHUNK keys."""
    return rows <= FUSED_ROWS and chunk <= FUSED_MAX_CHUNK and cooperative(rows, n_cols, chunk, like)


def _launch_workspace(scores: torch.Tensor, chunk: int, who: str) -> tuple[torch.Tensor, torch.Tensor, tuple, dict]:
    """(workspace rows, the chunks' counts, grid, keywords with the switches) of a cooperative launch over `scores`;
    an error where `coop_fits` says no or under the interpreter: never a launch that could wait forever at its first
    barrier. With COUNT_POLL the counts live in the workspace rows, so no counts tensor is made (the kernel's
    `cnt_ptr`, unread, is given the workspace)."""
    if chunk >= COOP_CHUNK_LIMIT.value:
        raise ValueError(f"{who}: chunk {chunk} is not below {COOP_CHUNK_LIMIT.value} keys "
                         "(the cooperative kernels' limit)")
    ws, counts, grid, kw = workspace(scores, chunk, _zeroed(scores), with_counts=not COUNT_POLL)
    if INTERPRET or not coop_fits(*grid, scores):
        raise ValueError(f"{who}: a cooperative launch of {grid[0]} x {grid[1]} programs "
                         f"{'under the interpreter' if INTERPRET else 'passes the SM count'}")
    return ws, ws if counts is None else counts, grid, {**kw, "POLL": HIST_POLL, "COUNT_POLL": COUNT_POLL}


def launch(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
           out: torch.Tensor, k: int, page_size: int, chunk: int) -> tuple:
    """`coop_select`'s one launch as (kernel, grid, arguments, keywords) over the shared zero workspace (up to
    COOP_WS_ROWS rows; else one zeroed here; tests compile it offline); an error where `coop_fits` says no or under
    the interpreter (never a launch that could wait forever at its first barrier)."""
    ws, counts, grid, kw = _launch_workspace(scores, chunk, "long_row_select")
    return (_coop_select_kernel, grid, (scores, page_table, req_index, positions, ws, counts, out, scores.shape[1], k,
                                        page_size, scores.stride(0), page_table.stride(0), out.stride(0), grid[1]),
            kw)


def coop_select(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
                out: torch.Tensor, k: int, page_size: int, chunk: int) -> None:
    """`triton_indexer_long.long_row_select`'s output in one launch (rows of one program an SM at most)."""
    if scores.shape[0]:
        kernel, grid, args, kw = launch(scores, page_table, req_index, positions, out, k, page_size, chunk)
        kernel[grid](*args, **kw)


def score_select_launch(q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor,
                        page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                        k: int, page_size: int, chunk: int, q_fp8: bool | None = None,
                        stages: int | None = None) -> tuple:
    """`coop_score_select`'s one launch as (kernel, grid, arguments, keywords): its score buffer (chunk-aligned,
    each program writes and reads only its own chunk's; with KEYS_FIRST only STAMPS write it) allocated here, the
    workspace `launch`'s; the same refusals as `launch`. stages: score tiles in flight (default the score kernel's;
    bench sweeps)."""
    n_cols = page_table.shape[1] * page_size
    meta = q_meta(index_cache, q, page_size, "coop_score_select", q_fp8)
    if chunk % DEFAULT_TILE["bs"]:
        raise ValueError(f"coop_score_select: chunk {chunk} is not a multiple of the score tile's "
                         f"{DEFAULT_TILE['bs']} keys")
    scores = torch.empty(q.shape[0], triton.cdiv(n_cols, chunk) * chunk, dtype=torch.float32, device=q.device)
    ws, counts, grid, kw = _launch_workspace(scores, chunk, "coop_score_select")
    q = q if q.stride(-1) == 1 else q.contiguous()
    args = (q, head_weights, index_cache, index_cache.view(torch.float32), scores, page_table, req_index, positions,
            ws, counts, out, q.shape[1], q.shape[2], n_cols, k, page_size, index_cache.stride(0), q.stride(0),
            q.stride(1), head_weights.stride(0), scores.stride(0), page_table.stride(0), out.stride(0), grid[1])
    return _coop_score_select_kernel, grid, args, {**kw, **meta, "BS": DEFAULT_TILE["bs"],
                                                   "KEYS_FIRST": KEYS_FIRST and chunk <= KEYS_FIRST_MAX_CHUNK,
                                                   "num_warps": DEFAULT_TILE["num_warps"],
                                                   "num_stages": stages or DEFAULT_TILE["num_stages"]}


def coop_score_select(q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor,
                      page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, out: torch.Tensor,
                      k: int, page_size: int, chunk: int, q_fp8: bool | None = None,
                      stages: int | None = None) -> None:
    """out [rows, >= k] <- `paged_index_scores` + `long_row_select` of a few rows, in one launch (rows x chunks <=
    the SM count; the page-major FP8 cache): the same slots, bit for bit."""
    if q.shape[0]:
        kernel, grid, args, kw = score_select_launch(q, head_weights, index_cache, page_table, req_index, positions,
                                                     out, k, page_size, chunk, q_fp8, stages)
        kernel[grid](*args, **kw)
