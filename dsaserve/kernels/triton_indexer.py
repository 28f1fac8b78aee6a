"""GPU DSA indexer top-k: `indexer_topk` (request path stage 6, full indexer layers).

Owns: the GPU variant of `reference.indexer_topk`, built to run inside a captured decode graph:
  1. scores over the paged indexer cache (`index_scores`): keys at positions 0..max_seq-1 of the token's request
     (max_seq = page_table.shape[1] * page_size, a static bound the graph runner fixes per bucket),
     sum_h w[t,h] * relu(q_h . k) times the key's FP32 scale (scale > 0 commutes with relu); keys past the
     token's position (causal) and past the page table are written as -inf, never read. FP8 keys:
     `triton_indexer_paged` (whole pages into a pipelined FP8 MMA, q rounded to e4m3 with one scale a head
     folded into its weight, as the prefill kernels round it); the plain debugging layouts: `_index_score_kernel`
     (bf16 q . k);
  2. selection: decode-size batches use a Triton kernel (a row that sees <= topk keys takes them all;
     otherwise a 4-way interpolation search, in registers up to 16K keys, finds the k-th largest score, then one
     compacting pass writes physical slots); large prefill slices use torch.topk + a page-table gather.
     When max_seq <= topk every visible key is selected and no score is computed.
No host loop over requests and no host sync: `seq_lens` / `extend_lens` (host lists in the reference
signature) are not needed, positions and req_index on the device say everything. The selection order is
by score but unsorted (`sorted=False`): consumers (sparse MLA) are order-free. Long prefill chunks are
scored in token slices so the score buffer stays under SCORE_BUDGET bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.common.kv_layout import KVLayout, get_kv_layout
from dsaserve.kernels import triton_indexer_paged
from dsaserve.kernels.triton_indexer_paged import page_split
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args
from dsaserve.kernels.variants import FEW_ROWS, ROW_IN_REGS_MAX, SELECT_MAX_ROWS

SCORE_BUDGET = 512 << 20  # bytes of fp32 scores per slice (8K tokens x 16K keys)


@triton.jit
def _index_score_kernel(q_ptr, w_ptr, k_ptr, pt_ptr, req_ptr, pos_ptr, out_ptr, n_heads, head_dim, page_size,
                        max_pages, skip_below, stride_qt, stride_qh, stride_wt, stride_k, stride_pt, stride_ot,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_KV: tl.constexpr,
                        PDL: tl.constexpr = False):
    """The plain (bf16 / fp32 debugging) layouts, whose page-major cache is rows of keys: one tile of BLOCK_KV
    keys a program (the FP8 layouts take `triton_indexer_paged`)."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0)
    kb = tl.program_id(1)
    offs_j = kb * BLOCK_KV + tl.arange(0, BLOCK_KV)
    pos = tl.load(pos_ptr + t)
    if pos < skip_below:  # the selection takes every visible key of this row without reading a score
        return
    out_ptrs = out_ptr + t.to(tl.int64) * stride_ot + offs_j
    if kb * BLOCK_KV > pos:  # the whole block is in this token's future
        tl.store(out_ptrs, tl.full([BLOCK_KV], float("-inf"), tl.float32))
        return
    req = tl.load(req_ptr + t).to(tl.int64)
    valid = (offs_j <= pos) & (offs_j < max_pages * page_size)
    page = tl.load(pt_ptr + req * stride_pt + offs_j // page_size, mask=valid, other=0)
    slot = (page * page_size + offs_j % page_size).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < n_heads
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < head_dim
    k = tl.load(k_ptr + slot[:, None] * stride_k + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    q = tl.load(q_ptr + t.to(tl.int64) * stride_qt + offs_h[:, None].to(tl.int64) * stride_qh + offs_d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0)
    s = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))  # [H, KV], fp32 accumulation
    w = tl.load(w_ptr + t.to(tl.int64) * stride_wt + offs_h, mask=offs_h < n_heads, other=0.0).to(tl.float32)
    score = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
    tl.store(out_ptrs, tl.where(valid, score, float("-inf")))


KEY_NEG_INF = tl.constexpr(-2139095041)  # _order_key(-inf): 0xFF800000 ^ 0x7FFFFFFF as int32


@triton.jit
def _order_key32(x):
    """float32 -> int32 with the same order (negative floats: flip the magnitude bits); -0.0 is +0.0, as the
    comparisons of torch.topk have it (scores of -0.0 come from relu(.) x a negative head weight)."""
    b = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
    return tl.where(b < 0, b ^ 0x7FFFFFFF, b)


@triton.jit
def _order_key(x):
    return _order_key32(x).to(tl.int64)


@triton.jit
def _key_value(key):
    """The float32 whose order key is `key` (an int64 scalar in the int32 range), as float64."""
    b = tl.where(key < 0, key ^ 0x7FFFFFFF, key).to(tl.int32)
    return b.to(tl.float32, bitcast=True).to(tl.float64)


@triton.jit
def _thresholds(lo, hi, c_lo, c_hi, k, interp):
    """Three search thresholds lo < m1 <= m2 <= m3 <= hi inside the bracket [lo, hi] of integer keys, where
    c_lo = count(key >= lo) >= k > c_hi = count(key > hi).

    interp: the score values where the counts would be k + g, k, k - g (g = 1/8 of the keys in the bracket)
    if the scores were spread evenly over the bracket's value range - in value space, not key space (the
    key of a float is log-like and folds at zero). Score rows are smooth, so a good step leaves ~1/4 of the
    bracket's keys or fewer; otherwise the quarter points of the key range, which shrink it 4x whatever the
    data (the caller alternates, so progress is guaranteed).
    """
    span = hi - lo + 1
    if interp != 0:
        n_in = c_lo - c_hi
        g = tl.maximum(n_in // 8, 1)
        v_lo = _key_value(lo)
        per_key = (_key_value(hi) - v_lo) / n_in.to(tl.float64)
        m1 = _order_key32((v_lo + (c_lo - k - g).to(tl.float64) * per_key).to(tl.float32)).to(tl.int64)
        m2 = _order_key32((v_lo + (c_lo - k).to(tl.float64) * per_key).to(tl.float32)).to(tl.int64)
        m3 = _order_key32((v_lo + (c_lo - k + g).to(tl.float64) * per_key).to(tl.float32)).to(tl.int64)
        m1 = tl.minimum(tl.maximum(m1, lo + 1), hi)
        m2 = tl.minimum(tl.maximum(m2, m1), hi)
        m3 = tl.minimum(tl.maximum(m3, m2), hi)
    else:
        m1 = lo + (span + 3) // 4
        m2 = lo + (2 * span + 3) // 4
        m3 = lo + (3 * span + 3) // 4
    return m1, m2, m3


@triton.jit
def _add2(a1, b1, a2, b2):
    return a1 + a2, b1 + b2


@triton.jit
def _counts(key, m1, m2, m3):
    """(count(key >= m1), count(key >= m2), count(key >= m3)) over a block of int32 keys (1-D or 2-D), in one
    reduction of two int32 lanes (m1 | m2 << 16 packed: at most 64K keys per block), int64 results."""
    a = (key >= m1.to(tl.int32)).to(tl.int32) + ((key >= m2.to(tl.int32)).to(tl.int32) << 16)
    b = (key >= m3.to(tl.int32)).to(tl.int32)
    if len(key.shape) == 2:
        a, b = tl.reduce((a, b), 1, _add2)
    c12, c3 = tl.reduce((a, b), 0, _add2)
    return (c12 & 0xFFFF).to(tl.int64), (c12 >> 16).to(tl.int64), c3.to(tl.int64)


@triton.jit
def _rank_2d(flag):
    """Inclusive prefix count of a [R, C] 0/1 int32 tensor in row-major (position) order: rows scanned
    inside their warps, then only the R row totals across the block. H200, the model's 8K-context rows
    (bench run 4): the write pass with one 1-D scan over the 16K-key register row took ~16 µs of a 28-36
    µs selection; in 4096-key chunks scanned this way the selection takes 25-31 µs."""
    per_row = tl.sum(flag, axis=1)
    return (tl.cumsum(per_row, axis=0) - per_row)[:, None] + tl.cumsum(flag, axis=1)


@triton.jit
def _narrow(lo, hi, c_lo, c_hi, m1, m2, m3, c1, c2, c3, k, interp):
    """The sub-bracket holding the k-th key, given the counts c_i = count(key >= m_i), and whether the
    next step interpolates: after an interpolated step that did not leave <= 1/4 of the bracket's keys, the
    next one takes quarter points. A threshold whose count is exactly k ends the search: the bracket
    collapses to m - 1 and both counts become k (then `key > lo` selects exactly k keys)."""
    exact = tl.where(c1 == k, m1, tl.where(c2 == k, m2, m3))
    done = (c1 == k) | (c2 == k) | (c3 == k)
    new_lo = tl.where(c3 >= k, m3, tl.where(c2 >= k, m2, tl.where(c1 >= k, m1, lo)))
    new_hi = tl.where(c3 >= k, hi, tl.where(c2 >= k, m3 - 1, tl.where(c1 >= k, m2 - 1, m1 - 1)))
    new_c_lo = tl.where(c3 >= k, c3, tl.where(c2 >= k, c2, tl.where(c1 >= k, c1, c_lo)))
    new_c_hi = tl.where(c3 >= k, c_hi, tl.where(c2 >= k, c3, tl.where(c1 >= k, c2, c1)))
    good = (new_c_lo - new_c_hi) * 4 <= c_lo - c_hi
    new_interp = tl.where((interp == 0) | good, 1, 0)
    new_lo = tl.where(done, exact - 1, new_lo)
    new_hi = tl.where(done, exact - 1, new_hi)
    new_c_lo = tl.where(done, k, new_c_lo)  # count(key > m - 1) = k: no tie is taken (`_write_selection`)
    new_c_hi = tl.where(done, k, new_c_hi)
    return new_lo, new_hi, new_c_lo, new_c_hi, new_interp


@triton.jit
def _search_in_registers(row, pos, n_cols, k, BLOCK: tl.constexpr):
    """The k-th largest key of one row held in registers -> (lo, c_lo, c_hi) as `_write_selection` takes
    them: a 4-way search on the key with no memory traffic. Each step counts the keys at or above three
    thresholds (`_thresholds`) in one block reduction (`_counts`); interpolated steps take 3-9 on the
    model's score rows where quarter points took 16."""
    j = tl.arange(0, BLOCK)
    visible = (j <= pos) & (j < n_cols)
    key = _order_key32(tl.load(row + j, mask=visible, other=float("-inf")))  # int32: half the registers
    lo = tl.min(tl.where(visible, key, 2147483647), axis=0).to(tl.int64)
    hi = tl.max(key, axis=0).to(tl.int64)
    c_lo = tl.minimum(pos + 1, n_cols).to(tl.int64)
    c_hi = tl.zeros([], dtype=tl.int64)
    interp = 1
    while lo < hi:  # invariant: count(key >= lo) = c_lo >= k > c_hi = count(key > hi)
        m1, m2, m3 = _thresholds(lo, hi, c_lo, c_hi, k, interp)
        c1, c2, c3 = _counts(key, m1, m2, m3)
        lo, hi, c_lo, c_hi, interp = _narrow(lo, hi, c_lo, c_hi, m1, m2, m3, c1, c2, c3, k, interp)
    return lo, c_lo, c_hi


@triton.jit
def _search_over_l2(row, pos, n_cols, k, BLOCK: tl.constexpr):
    """`_search_in_registers` for rows longer than the registers hold: a min/max pass, then one counting
    pass over the row's causal prefix (from L2, BLOCK keys at a time) per step."""
    offs = tl.arange(0, BLOCK)
    n_scan = tl.minimum(tl.cdiv(pos + 1, BLOCK) * BLOCK, n_cols)  # past the position all is -inf
    lo = tl.zeros([], dtype=tl.int64) + 2147483647
    hi = tl.zeros([], dtype=tl.int64) + KEY_NEG_INF
    for c0 in range(0, n_scan, BLOCK):  # the bracket starts at the visible keys' range, not all of int32
        j = c0 + offs
        key = _order_key(tl.load(row + j, mask=(j <= pos) & (j < n_cols), other=float("-inf")))
        lo = tl.minimum(lo, tl.min(tl.where((j <= pos) & (j < n_cols), key, 2147483647), axis=0))
        hi = tl.maximum(hi, tl.max(key, axis=0))
    c_lo = tl.minimum(pos + 1, n_cols).to(tl.int64)
    c_hi = tl.zeros([], dtype=tl.int64)
    interp = 1
    while lo < hi:
        m1, m2, m3 = _thresholds(lo, hi, c_lo, c_hi, k, interp)
        c1 = tl.zeros([], dtype=tl.int64)
        c2 = tl.zeros([], dtype=tl.int64)
        c3 = tl.zeros([], dtype=tl.int64)
        for c0 in range(0, n_scan, BLOCK):  # past the position a row may be unwritten (gemm's workspace)
            x = tl.load(row + c0 + offs, mask=(c0 + offs <= pos) & (c0 + offs < n_cols), other=float("-inf"))
            d1, d2, d3 = _counts(_order_key32(x), m1, m2, m3)
            c1, c2, c3 = c1 + d1, c2 + d2, c3 + d3
        lo, hi, c_lo, c_hi, interp = _narrow(lo, hi, c_lo, c_hi, m1, m2, m3, c1, c2, c3, k, interp)
    return lo, c_lo, c_hi


@triton.jit
def _write_selection(row, pt_ptr, out_row, pt_off, pos, n_cols, k, page_size, lo, c_lo, c_hi,
                     CH: tl.constexpr):
    """One pass over the row's causal prefix (from L2) in CH-key chunks held as [CH / 128, 128]: every key
    above lo, then the first k - c_hi keys equal to it (position order) -> physical slots, compacted in
    position order by `_rank_2d`. The search ended with lo == hi (c_hi keys above, c_lo - c_hi equal), or
    on a threshold with exactly k keys above lo (c_lo = c_hi = k): then no tie is taken."""
    C: tl.constexpr = 128 if CH >= 128 else CH
    offs = (tl.arange(0, CH // C) * C)[:, None] + tl.arange(0, C)[None, :]
    lo32 = lo.to(tl.int32)
    need = k - c_hi
    rank_ties = c_lo - c_hi > need  # more ties than places: rank them
    base = tl.zeros([], dtype=tl.int32)
    ties = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, tl.minimum(pos + 1, n_cols), CH):
        j = c0 + offs
        key = _order_key32(tl.load(row + j, mask=(j <= pos) & (j < n_cols), other=float("-inf")))
        eq = (key == lo32).to(tl.int32)
        if rank_ties:
            take = (eq == 1) & (ties + _rank_2d(eq) - 1 < need)
        else:
            take = (eq == 1) & (need > 0)
        sel = ((key > lo32) | take).to(tl.int32)
        page = tl.load(pt_ptr + pt_off + j // page_size, mask=sel == 1, other=0)
        tl.store(out_row + base + _rank_2d(sel) - 1, page * page_size + j % page_size, mask=sel == 1)
        base += tl.sum(tl.sum(sel, axis=1), axis=0)
        ties += tl.sum(tl.sum(eq, axis=1), axis=0)


# stride_pt not specialised: an eager prefill's page table is as wide as its longest request (engine/batch.py), so
# its divisibility by 16 is the context's, and no warmup shape can stand for every context
@triton.jit(do_not_specialize=["stride_pt"])
def _topk_select_kernel(score_ptr, pt_ptr, req_ptr, pos_ptr, out_ptr, n_cols, k, page_size, stride_s, stride_pt,
                        stride_o, BLOCK: tl.constexpr, ROW_IN_REGS: tl.constexpr, PDL: tl.constexpr = False):
    """One row per program: the k largest scores' positions -> physical slots, in position order.

    A row whose token sees at most k keys takes them all (no scores are read). A row that fits in
    registers (ROW_IN_REGS) is loaded once and searched there (`_search_in_registers`); a longer row is
    searched the same way with one counting pass over L2 per step (`_search_over_l2`). One pass then writes
    every position above the k-th plus the first (k - #above) ties (`_write_selection`). -inf (not
    visible) is never selected. All k outputs of a row are written (-1 where nothing is selected). Only
    the row's causal prefix is scanned: a graph captured for a long static context pays for the tokens'
    real contexts, not the bound. H200, the model's 8K-context rows (8256-key bound; bench run 4, graph
    replay, incl. ~8 µs of launch floor): quarter-point search in registers 44-53 µs, interpolated in
    value space 35-38 µs. Slower and dropped: the same search over L2 in 4096-key chunks (39-49 µs),
    `tl.histogram` searches (1024 bins, <= 4 levels: ~65 µs), a 256-bin histogram radix select (~100 µs:
    nearly all keys share their top byte, so its shared-memory atomics serialise), 16-way counting passes
    over L2 (~114 µs).
    """
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    row = score_ptr + t * stride_s
    pos = tl.load(pos_ptr + t)
    req = tl.load(req_ptr + t).to(tl.int64)
    if pos < k:  # every visible key is selected, the rest of the row is -1
        for c0 in range(0, k, 1024):
            j = c0 + tl.arange(0, 1024)
            page = tl.load(pt_ptr + req * stride_pt + j // page_size, mask=j <= pos, other=0)
            tl.store(out_ptr + t * stride_o + j, tl.where(j <= pos, page * page_size + j % page_size, -1), mask=j < k)
        return
    if ROW_IN_REGS:  # the whole row lives in registers: a search step costs a block reduction
        lo, c_lo, c_hi = _search_in_registers(row, pos, n_cols, k, BLOCK)
    else:
        lo, c_lo, c_hi = _search_over_l2(row, pos, n_cols, k, BLOCK)
    CH: tl.constexpr = 4096 if BLOCK > 4096 else BLOCK
    _write_selection(row, pt_ptr, out_ptr + t * stride_o, req * stride_pt, pos, n_cols, k, page_size, lo, c_lo,
                     c_hi, CH)


def index_scores(q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor, layout: KVLayout | str,
                 page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, page_size: int,
                 skip_below: int = 0, tile: dict | None = None, fill: bool = True) -> torch.Tensor:
    """[T, max_seq] fp32 causal index scores (-inf where not visible). Rows whose position is below
    skip_below are left unwritten (the decode selection takes all their keys without reading a score); without
    `fill` the FP8 layouts may leave the keys past a row's position unwritten too (the Triton selects read none).
    The FP8 layouts take `triton_indexer_paged` (tile: its DEFAULT_TILE's keys, bench sweeps), the plain ones
    `_index_score_kernel`."""
    t, n_heads, head_dim = q.shape
    layout = get_kv_layout(layout, "index_scores: layout")
    if layout.plain_dtype is None:
        return triton_indexer_paged.paged_index_scores(q, head_weights, index_cache, page_table, req_index,
                                                       positions, page_size, skip_below, tile, fill=fill)
    max_seq, block_kv = page_table.shape[1] * page_size, 128
    rows = index_cache.view(getattr(torch, layout.plain_dtype)).view(-1, head_dim)  # plain pages are rows
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty(t, triton.cdiv(max_seq, block_kv) * block_kv, dtype=torch.float32, device=q.device)
    if t == 0:
        return out[:, :max_seq]
    _index_score_kernel[(t, triton.cdiv(max_seq, block_kv))](
        q, head_weights, rows, page_table, req_index, positions, out, n_heads, head_dim, page_size,
        page_table.shape[1], skip_below, q.stride(0), q.stride(1), head_weights.stride(0), rows.stride(0),
        page_table.stride(0), out.stride(0), BLOCK_H=max(16, triton.next_power_of_2(n_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_KV=block_kv, num_warps=4, **pdl_args(q.device))
    return out[:, :max_seq]


# ROW_IN_REGS_MAX (kernels/variants.py): keys per row up to which the selection holds the row in registers
# (16 warps; ptxas -v for sm_90: no spills at 8K, 132 bytes at 16K). The model's 8K-context rows (8256-key
# bound, bench run 4): 35-38 µs per row in registers against 39-49 µs in 4096-key chunks over L2


def _select_config(max_seq: int, rows: int) -> dict:
    if max_seq <= ROW_IN_REGS_MAX:
        return {"BLOCK": triton.next_power_of_2(max_seq), "ROW_IN_REGS": True, "num_warps": 16 if max_seq > 4096 else 8}
    return {"BLOCK": 4096, "ROW_IN_REGS": False, "num_warps": 16 if rows <= FEW_ROWS else 8}


def row_select_launch(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor,
                      positions: torch.Tensor, out: torch.Tensor, n_cols: int, k: int, page_size: int) -> tuple:
    """`_topk_select_kernel`'s (grid, arguments, keywords) over the rows of `scores` (one program a row; tests
    compile it offline: one variant per block class, whatever the page-table width)."""
    rows = scores.shape[0]
    return ((rows,), (scores, page_table, req_index, positions, out, n_cols, k, page_size, scores.stride(0),
                      page_table.stride(0), out.stride(0)), {**_select_config(n_cols, rows), **pdl_args(scores.device)})


@triton.jit
def page_slots(pt_row, j, page_size, mask):
    """Physical slots of key positions j (>= 0) through one request's page-table row (`page_split`)."""
    col, off = page_split(j, page_size)
    page = tl.load(pt_row + col, mask=mask, other=0)
    return page * page_size + off


@triton.jit
def _take_all_kernel(pt_ptr, req_ptr, pos_ptr, out_ptr, max_seq, topk, page_size, stride_pt, stride_ot,
                     BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """out[r, j] = the physical slot of key j of row r's request for j <= its position (and < max_seq), else -1."""
    grid_dependency_sync(PDL)
    r = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    visible = (j <= tl.load(pos_ptr + r)) & (j < max_seq)
    pt_row = pt_ptr + tl.load(req_ptr + r) * stride_pt
    tl.store(out_ptr + r * stride_ot + j, tl.where(visible, page_slots(pt_row, j, page_size, visible), -1),
             mask=j < topk)


def take_all(page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, topk: int,
             page_size: int) -> torch.Tensor:
    """[T, topk] int64: every key a row sees (0..its position), as physical slots, then -1: the selection when
    the static row bound (page_table.shape[1] * page_size) is at most topk. One launch (it was ten torch ops, ~15
    us a full layer of a batch-1 decode step, bench/RESULTS.md). The kernel reads the page table's rows as
    contiguous pages (stride 1), as the scoring and selection kernels do."""
    t = req_index.shape[0]
    page_table = page_table if page_table.stride(1) == 1 else page_table.contiguous()
    out = torch.empty((t, topk), dtype=torch.int64, device=page_table.device)
    if t:
        block = min(1024, triton.next_power_of_2(topk))
        _take_all_kernel[(t, triton.cdiv(topk, block))](page_table, req_index, positions, out,
                                                        page_table.shape[1] * page_size, topk, page_size,
                                                        page_table.stride(0), out.stride(0), BLOCK=block,
                                                        **pdl_args(page_table.device))
    return out


def indexer_topk(q: torch.Tensor | None, head_weights: torch.Tensor | None, index_cache: torch.Tensor,
                 layout: KVLayout | str, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
                 topk: int, page_size: int, seq_lens: list[int] | None = None,
                 extend_lens: list[int] | None = None) -> torch.Tensor:
    """GPU `reference.indexer_topk` -> [T, topk] int64 physical slots, -1 padded (seq/extend lens unused). q and
    head_weights may be None only within the top-k (the dispatch checks): `take_all` reads neither."""
    layout = get_kv_layout(layout, "indexer_topk: layout")
    t = req_index.shape[0]
    max_seq = page_table.shape[1] * page_size
    k = min(topk, max_seq)
    # slices start at multiples of 16 rows: their int64 position / request pointers stay 16-byte aligned, so
    # a sliced chunk launches the variant the warmup compiled (Triton specialises on pointer alignment)
    step = max(16, SCORE_BUDGET // (4 * max(max_seq, 1)) // 16 * 16)
    if max_seq <= topk:  # every visible key is selected: no scores needed
        return take_all(page_table, req_index, positions, topk, page_size)
    out = torch.empty((t, topk), dtype=torch.int64, device=q.device)  # k == topk here: every slot is written
    for s0 in range(0, t, step):
        sl = slice(s0, min(t, s0 + step))
        select = t <= SELECT_MAX_ROWS
        scores = index_scores(q[sl], head_weights[sl], index_cache, layout, page_table, req_index[sl],
                              positions[sl], page_size, skip_below=k if select else 0)
        if select:
            grid, args, kwargs = row_select_launch(scores, page_table, req_index[sl], positions[sl], out[sl],
                                                   max_seq, k, page_size)
            _topk_select_kernel[grid](*args, **kwargs)
            continue
        vals, idx = scores.topk(k, dim=1, sorted=False)
        slots = page_table[req_index[sl, None], idx // page_size] * page_size + idx % page_size
        out[sl, :k] = slots.masked_fill_(vals == float("-inf"), -1)
    return out
