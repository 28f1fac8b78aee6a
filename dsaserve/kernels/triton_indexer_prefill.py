"""Prefill DSA indexer: scores as one tensor-core GEMM with a streaming top-k (request path stage 6, full
indexer layers; `triton_indexer_dispatch` sends prefill-size batches with FP8 keys here).

Owns: `prefill_topk`, the GPU `reference.indexer_topk` for batches of more than SELECT_MAX_ROWS tokens; it
never writes the [tokens x context] score matrix. One program per block of BM query tokens of one request
sweeps that request's keys 0..max position in tiles of BN keys:
  scores: q / s rounded to e4m3, one s = amax / 448 per (token, head), folded into the head weight (s > 0
      commutes with the ReLU; DeepGEMM's fp8_mqa_logits also takes FP8 q with the scale in the weights;
      DSASERVE_FP8_ACTIVATIONS=0 rounds q / s to fp16 instead: the bf16 input to 2^-12). Keys are FP8
      straight from their pages (`common/index_pages.py`; at D = 128 as int32 words in 4 byte planes).
      `tl.dot` swap-AB: keys are the MMA's rows, (token, head) its columns, so a token's head sum stays in a
      thread and its quad (DeepGEMM's sm90 layout), not across warps; ReLU, the weights, the head sum and the
      key scale are the epilogue, and a score leaves registers only as a candidate.
  selection: each token keeps a running threshold theta (the exact k-th largest key seen so far, or -inf)
      and appends (order key, position) of every score above it to its own buffer of CAP entries in HBM.
      When a buffer might not take MIN_ROOM_TILES more tiles, the block's rows are compacted together: the
      interpolated 4-way search of `triton_indexer` (vectorised over rows, over the L2-resident buffers)
      finds each row's k-th largest key, the buffer keeps exactly the top k (ties by position) and theta
      rises to it. After the sweep the same compaction writes the physical slots. Between compactions the
      tile loop has no data-dependent branch, so Triton pipelines it (cp.async of the key words).
Why a running threshold, not a score histogram or two GEMM passes: the threshold is exact from the first
compaction on (when 2k keys are in), so afterwards only keys above the k-th largest so far are written,
~k ln(n / 2k) per row for scores in no particular order: a row pays ~1 + ln(n / 2k) compactions of a few
passes over 2k keys in L2, and the GEMM runs once. Scores rising along the context compact more often but
stay exact. Output: the slots, in position order with ties in position order, as the decode kernels give
them; -1 past a token's visible keys. Buffers: CAP x 8 bytes per token, at most BUF_BUDGET per launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.common import envs
from dsaserve.common.index_pages import page_size_of
from dsaserve.common.kv_layout import KVLayout, get_kv_layout
from dsaserve.kernels.triton_indexer import KEY_NEG_INF, _narrow, _order_key32, _thresholds
from dsaserve.kernels.triton_indexer_paged import fp8_q_scale, key_place, quant_q
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

BN = 128  # keys per tile: the MMA's M (two warpgroups of 64 rows)
NCOL = 128  # MMA N: query tokens per program x heads padded to a power of two (32 heads -> 4 tokens)
CC = 512  # buffer columns per pass of a compaction ([BM, CC] keys in registers)
MIN_ROOM_TILES = tl.constexpr(4)  # compact when a buffer has room for fewer than this many tiles
BUF_BUDGET = 256 << 20  # candidate-buffer bytes per launch (8192 tokens at CAP 4096)
HEAD_DIMS = (32, 64, 128)  # 128: int32 words in 4 byte planes (K = 32 each); 32 / 64: byte rows, one dot


def supported(layout: KVLayout, head_dim: int) -> bool:
    """FP8 keys (D e4m3 + a scale) and a head dim the kernel tiles; other layouts keep `triton_indexer`."""
    return layout.plain_dtype is None and head_dim in HEAD_DIMS


def capacity(k: int, bn: int = BN) -> int:
    """Buffer entries per token: at least 2k (a compaction halves it) and room for 8 tiles above k."""
    return triton.next_power_of_2(max(2 * k, k + 8 * bn))


@triton.jit
def _plane(words, j: tl.constexpr, Q_FP8: tl.constexpr):
    """Byte j of every int32 word as e4m3 (fp16, exactly, when q is fp16): key dims j, j+4, ..."""
    b = ((words >> (8 * j)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    if not Q_FP8:
        b = b.to(tl.float16)
    return b


@triton.jit
def _load_q(q_ptr, ctok, ch, cmask, stride_qt, stride_qh, D4: tl.constexpr, j: tl.constexpr, WORDS: tl.constexpr):
    """[D4, NCOL] fp32 block of the MMA's B operand: dims j, j+4, ... (plane j of the key words) or all D."""
    d = tl.arange(0, D4)
    if WORDS:
        d = d * 4 + j
    return tl.load(q_ptr + ctok[None, :] * stride_qt + ch[None, :] * stride_qh + d[:, None], mask=cmask[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _tile_scores(q0, q1, q2, q3, w, kq_ptr, ks_ptr, pt_row, offs_j, jmask, page_size, page_bytes,
                 BM: tl.constexpr, BN: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, WORDS: tl.constexpr,
                 Q_FP8: tl.constexpr):
    """[BN, BM] scores of one key tile: sum_h w'[t,h] relu(q8[t,h] . k8_j) * key scale_j."""
    kbyte, sidx = key_place(pt_row, offs_j, jmask, page_size, page_bytes, D)
    acc = tl.zeros([BN, BM * HP], dtype=tl.float32)
    if WORDS:
        words = tl.load(kq_ptr + (kbyte // 4)[:, None] + tl.arange(0, D // 4)[None, :], mask=jmask[:, None],
                        other=0)
        acc = tl.dot(_plane(words, 0, Q_FP8), q0, acc)
        acc = tl.dot(_plane(words, 1, Q_FP8), q1, acc)
        acc = tl.dot(_plane(words, 2, Q_FP8), q2, acc)
        acc = tl.dot(_plane(words, 3, Q_FP8), q3, acc)
    else:
        kb = tl.load(kq_ptr + kbyte[:, None] + tl.arange(0, D)[None, :], mask=jmask[:, None], other=0)
        kb = kb.to(tl.float8e4nv, bitcast=True)
        if not Q_FP8:
            kb = kb.to(tl.float16)
        acc = tl.dot(kb, q0, acc)
    s = tl.sum(tl.reshape(tl.maximum(acc, 0.0) * w[None, :], [BN, BM, HP]), axis=2)
    return s * tl.load(ks_ptr + sidx, mask=jmask, other=1.0)[:, None]


@triton.jit
def _row_counts(key, valid, m1, m2, m3):
    """Per row of [BM, CC] int32 keys: (count >= m1, >= m2, >= m3) as int64, m1 | m2 << 16 in one reduction."""
    a = ((key >= m1.to(tl.int32)[:, None]) & valid).to(tl.int32)
    a += ((key >= m2.to(tl.int32)[:, None]) & valid).to(tl.int32) << 16
    a = tl.sum(a, axis=1)
    b = tl.sum(((key >= m3.to(tl.int32)[:, None]) & valid).to(tl.int32), axis=1)
    return (a & 0xFFFF).to(tl.int64), (a >> 16).to(tl.int64), b.to(tl.int64)


@triton.jit
def _kth_keys(bufk_ptr, brow, cnt, cut, k, CAP: tl.constexpr, CC: tl.constexpr):
    """Per buffer row with cnt > k (`cut`): (lo, c_hi) of `triton_indexer._search_in_registers` over its
    entries (every key above lo, plus k - c_hi keys equal to lo, are the top k). Rows not cut get lo below
    every key (all kept). All rows step together; a row whose bracket closed stays put."""
    cols = tl.arange(0, CC)
    n_max = tl.max(cnt, axis=0)
    lo = brow * 0 + 2147483647
    hi = brow * 0 - 2147483648
    for c0 in range(0, n_max, CC):
        valid = (c0 + cols)[None, :] < cnt[:, None]
        key = tl.load(bufk_ptr + brow[:, None] * CAP + c0 + cols[None, :], mask=valid, other=0)
        lo = tl.minimum(lo, tl.min(tl.where(valid, key, 2147483647), axis=1).to(tl.int64))
        hi = tl.maximum(hi, tl.max(tl.where(valid, key, -2147483648), axis=1).to(tl.int64))
    lo = tl.where(cut, lo, -2147483649)
    hi = tl.where(cut, hi, lo)
    c_lo = cnt.to(tl.int64)
    c_hi = c_lo * 0
    interp = cnt * 0 + 1
    while tl.max(hi - lo, axis=0) > 0:
        active = lo < hi
        n_in_safe = tl.where(active, c_hi, c_lo - 1)  # a closed row's bracket may be empty: no 0 / 0
        a1, a2, a3 = _thresholds(lo, hi, c_lo, n_in_safe, k, 1)
        b1, b2, b3 = _thresholds(lo, hi, c_lo, n_in_safe, k, 0)
        m1, m2, m3 = tl.where(interp != 0, a1, b1), tl.where(interp != 0, a2, b2), tl.where(interp != 0, a3, b3)
        c1, c2, c3 = c_lo * 0, c_lo * 0, c_lo * 0
        for c0 in range(0, n_max, CC):
            valid = (c0 + cols)[None, :] < cnt[:, None]
            key = tl.load(bufk_ptr + brow[:, None] * CAP + c0 + cols[None, :], mask=valid, other=0)
            d1, d2, d3 = _row_counts(key, valid, m1, m2, m3)
            c1, c2, c3 = c1 + d1, c2 + d2, c3 + d3
        n_lo, n_hi, n_clo, n_chi, n_interp = _narrow(lo, hi, c_lo, c_hi, m1, m2, m3, c1, c2, c3, k, interp)
        lo, hi = tl.where(active, n_lo, lo), tl.where(active, n_hi, hi)
        c_lo, c_hi = tl.where(active, n_clo, c_lo), tl.where(active, n_chi, c_hi)
        interp = tl.where(active, n_interp, interp)
    return lo, c_hi


@triton.jit
def _compact(bufk_ptr, bufp_ptr, brow, cnt, theta, k, out_ptr, rows, rmask, pt_row, page_size, stride_o,
             CAP: tl.constexpr, CC: tl.constexpr, FINAL: tl.constexpr):
    """Rows with more than k entries keep exactly their top k, in buffer (= position) order -> (theta, cnt).
    FINAL: write every row's kept entries as physical slots to out (then -1 up to k), not back to the buffer."""
    tl.debug_barrier()  # the appends of every thread are in memory
    cut = cnt > k
    lo, c_hi = _kth_keys(bufk_ptr, brow, cnt, cut, k, CAP, CC)
    need = tl.where(cut, k - c_hi, 0)
    cols = tl.arange(0, CC)
    base = cnt * 0
    ties = cnt * 0
    for c0 in range(0, tl.max(cnt, axis=0), CC):
        valid = (c0 + cols)[None, :] < cnt[:, None]
        at = brow[:, None] * CAP + c0 + cols[None, :]
        key = tl.load(bufk_ptr + at, mask=valid, other=0)
        p = tl.load(bufp_ptr + at, mask=valid, other=0)
        eq = (valid & (key == lo[:, None])).to(tl.int32)
        take = (eq == 1) & (ties[:, None] + tl.cumsum(eq, axis=1) - 1 < need[:, None])
        keep = ((valid & (key > lo[:, None])) | take).to(tl.int32)
        dest = base[:, None] + tl.cumsum(keep, axis=1) - 1
        if FINAL:
            page = tl.load(pt_row + p // page_size, mask=keep == 1, other=0)
            tl.store(out_ptr + rows[:, None] * stride_o + dest, page * page_size + p % page_size,
                     mask=(keep == 1) & rmask[:, None])
        else:
            tl.debug_barrier()  # every thread read this chunk before an entry moves down into it
            tl.store(bufk_ptr + brow[:, None] * CAP + dest, key, mask=keep == 1)
            tl.store(bufp_ptr + brow[:, None] * CAP + dest, p, mask=keep == 1)
        base += tl.sum(keep, axis=1)
        ties += tl.sum(eq, axis=1)
    if FINAL:
        for c0 in range(0, k, CC):
            c = (c0 + cols)[None, :]
            tl.store(out_ptr + rows[:, None] * stride_o + c, tl.full([1, CC], -1, tl.int64),
                     mask=(c >= base[:, None]) & (c < k) & rmask[:, None])
    tl.debug_barrier()  # the moved entries are in memory before the next appends
    return tl.where(cut, lo.to(tl.int32), theta), base


@triton.jit
def _prefill_topk_kernel(q_ptr, w_ptr, kq_ptr, ks_ptr, pt_ptr, req_ptr, pos_ptr, blk_ptr, bufk_ptr, bufp_ptr,
                         out_ptr, n_tok, n_heads, k, page_size, max_pages, stride_qt, stride_qh, stride_wt,
                         page_bytes, stride_pt, stride_o, HP: tl.constexpr, D: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, CAP: tl.constexpr, CC: tl.constexpr,
                         WORDS: tl.constexpr, Q_FP8: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    blk = tl.program_id(0)
    t0 = tl.load(blk_ptr + blk)
    rows = t0 + tl.arange(0, BM)
    req = tl.load(req_ptr + t0)
    rmask = rows < n_tok
    rmask = rmask & (tl.load(req_ptr + rows, mask=rmask, other=-1) == req)
    rpos = tl.load(pos_ptr + rows, mask=rmask, other=-1).to(tl.int32)  # -1: another request's token
    n = tl.arange(0, BM * HP)  # MMA column n = (token n // HP, head n % HP)
    ctok = t0 + n // HP
    ch = n % HP
    cmask = (ch < n_heads) & (ctok < n_tok)
    w = tl.load(w_ptr + ctok * stride_wt + ch, mask=cmask, other=0.0)
    D4: tl.constexpr = D // 4 if WORDS else D
    q0 = _load_q(q_ptr, ctok, ch, cmask, stride_qt, stride_qh, D4, 0, WORDS)
    q1, q2, q3 = q0, q0, q0
    if WORDS:
        q1 = _load_q(q_ptr, ctok, ch, cmask, stride_qt, stride_qh, D4, 1, WORDS)
        q2 = _load_q(q_ptr, ctok, ch, cmask, stride_qt, stride_qh, D4, 2, WORDS)
        q3 = _load_q(q_ptr, ctok, ch, cmask, stride_qt, stride_qh, D4, 3, WORDS)
    # one scale per (token, head) = amax / 448 (kv_layout's FP8 rule), > 0, so it leaves the ReLU and
    # joins the head weight (`triton_indexer_paged.fp8_q_scale` / `quant_q`: prepare_q's rule; fp16 q because the
    # interpreter's bf16 dot is broken, its fp16 one is not)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(q0), axis=0), tl.max(tl.abs(q1), axis=0)),
                      tl.maximum(tl.max(tl.abs(q2), axis=0), tl.max(tl.abs(q3), axis=0)))
    qscale = fp8_q_scale(amax)
    w = w * qscale
    q0, q1 = quant_q(q0, qscale[None, :], Q_FP8), quant_q(q1, qscale[None, :], Q_FP8)
    q2, q3 = quant_q(q2, qscale[None, :], Q_FP8), quant_q(q3, qscale[None, :], Q_FP8)
    pt_row = pt_ptr + req.to(tl.int64) * stride_pt
    brow = blk.to(tl.int64) * BM + tl.arange(0, BM)
    theta = tl.full([BM], KEY_NEG_INF, tl.int32)  # candidates have key > theta
    cnt = tl.zeros([BM], dtype=tl.int32)
    n_keys = tl.minimum(tl.max(rpos, axis=0) + 1, max_pages * page_size)
    j0 = n_keys * 0
    while j0 < n_keys:
        if tl.max(cnt, axis=0) > CAP - MIN_ROOM_TILES * BN:
            theta, cnt = _compact(bufk_ptr, bufp_ptr, brow, cnt, theta, k, out_ptr, rows, rmask, pt_row, page_size,
                                  stride_o, CAP, CC, False)
        j_end = tl.minimum(n_keys, j0 + (CAP - tl.max(cnt, axis=0)) // BN * BN)  # no buffer can overflow
        for j in range(j0, j_end, BN):
            offs_j = j + tl.arange(0, BN)
            jmask = offs_j < n_keys
            s = _tile_scores(q0, q1, q2, q3, w, kq_ptr, ks_ptr, pt_row, offs_j, jmask, page_size, page_bytes, BM,
                             BN, HP, D, WORDS, Q_FP8)
            key = _order_key32(s)
            cand = jmask[:, None] & (offs_j[:, None] <= rpos[None, :]) & (key > theta[None, :])
            c32 = cand.to(tl.int32)
            at = brow[None, :] * CAP + cnt[None, :] + tl.cumsum(c32, axis=0) - 1
            tl.store(bufk_ptr + at, key, mask=cand)
            tl.store(bufp_ptr + at, tl.broadcast_to(offs_j[:, None], [BN, BM]), mask=cand)
            cnt += tl.sum(c32, axis=0)
        j0 = j_end
    _compact(bufk_ptr, bufp_ptr, brow, cnt, theta, k, out_ptr, rows, rmask, pt_row, page_size, stride_o, CAP, CC,
             True)


def _block_starts(seq_lens: list[int], extend_lens: list[int], bm: int) -> list[int]:
    """First token of every block of <= bm tokens of one request, the longest key sweeps first (causal: the
    last blocks of a long request see the most keys), so the grid's tail is short blocks."""
    blocks, tok = [], 0
    for s, e in zip(seq_lens, extend_lens, strict=True):
        blocks += [(s - e + min(i + bm, e) - 1, tok + i) for i in range(0, e, bm)]
        tok += e
    return [t0 for _, t0 in sorted(blocks, reverse=True)]


def _host_lens(req_index: torch.Tensor, positions: torch.Tensor) -> tuple[list[int], list[int]]:
    """(seq_lens, extend_lens) from the device tensors when the caller has no host copy (one sync)."""
    req, pos = req_index.tolist(), positions.tolist()
    seq, ext = [0] * (max(req) + 1), [0] * (max(req) + 1)
    for r, p in zip(req, pos, strict=True):
        seq[r], ext[r] = max(seq[r], p + 1), ext[r] + 1
    return seq, ext


def prefill_topk(q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor, layout: KVLayout | str,
                 page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, topk: int,
                 page_size: int, seq_lens: list[int] | None = None, extend_lens: list[int] | None = None,
                 q_fp8: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """`reference.indexer_topk` for FP8 index keys (`supported`) -> [T, topk] int64 slots in position order,
    -1 padded. q_fp8: None follows DSASERVE_FP8_ACTIVATIONS. config: bn / ncol / cap / num_warps / num_stages
    (tests and the benchmark's sweep)."""
    t, n_heads, d = q.shape
    layout = get_kv_layout(layout, "prefill_topk: layout")
    if not supported(layout, d):
        raise ValueError(f"prefill_topk: layout {layout} / head dim {d} not supported (FP8 keys, {HEAD_DIMS})")
    conf = {"bn": BN, "ncol": NCOL, "num_warps": 8, "num_stages": 2, **(config or {})}
    q_fp8 = envs.DSASERVE_FP8_ACTIVATIONS != "0" if q_fp8 is None else q_fp8
    out = torch.empty((t, topk), dtype=torch.int64, device=q.device)
    if t == 0:
        return out
    if seq_lens is None or extend_lens is None:
        seq_lens, extend_lens = _host_lens(req_index, positions)
    hp = triton.next_power_of_2(n_heads)
    bm, cap, words = max(1, conf["ncol"] // hp), conf.get("cap") or capacity(topk, conf["bn"]), d % 128 == 0
    if cap < topk + conf["bn"]:
        raise ValueError(f"prefill_topk: buffer of {cap} entries cannot hold top-{topk} + a {conf['bn']}-key tile")
    page_size_of(index_cache, layout, d, "prefill_topk", expect=page_size)
    qk, w = q if q.stride(-1) == 1 else q.contiguous(), head_weights.float().contiguous()
    kq = index_cache.view(torch.int32) if words else index_cache
    ks = index_cache.view(torch.float32)
    starts = torch.tensor(_block_starts(seq_lens, extend_lens, bm), dtype=torch.int32, device=q.device)
    per_launch = max(1, BUF_BUDGET // (8 * cap * bm))
    n_buf = min(per_launch, starts.numel()) * bm
    bufk = torch.empty((n_buf, cap), dtype=torch.int32, device=q.device)
    bufp = torch.empty((n_buf, cap), dtype=torch.int32, device=q.device)
    for b0 in range(0, starts.numel(), per_launch):
        blk = starts[b0:b0 + per_launch]
        _prefill_topk_kernel[(blk.numel(),)](
            qk, w, kq, ks, page_table, req_index, positions, blk, bufk, bufp, out, t, n_heads, topk, page_size,
            page_table.shape[1], qk.stride(0), qk.stride(1), w.stride(0), index_cache.stride(0), page_table.stride(0),
            out.stride(0), HP=hp, D=d, BM=bm, BN=conf["bn"], CAP=cap, CC=min(CC, cap),
            WORDS=words, Q_FP8=q_fp8, num_warps=conf["num_warps"], num_stages=conf["num_stages"],
            **pdl_args(q.device))
    return out
