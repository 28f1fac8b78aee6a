"""Prefill DSA indexer as a tiled FP8 GEMM into a bounded score workspace, then a split radix select
(request path stage 6, full indexer layers; `triton_indexer_dispatch` sends prefill-size batches with FP8
keys here, `triton_indexer_prefill` is the fallback).

Owns: `gemm_topk` (the GPU `reference.indexer_topk` for prefill batches), `chunk_scores` (the score GEMM
alone, for the benchmark) and the operand preparation they share.
  operands: q / s rounded to e4m3 with one s = amax / 448 per (token, head) folded into the head weight
      (s > 0 commutes with the ReLU; DeepGEMM's fp8_mqa_logits takes FP8 q the same way;
      DSASERVE_FP8_ACTIVATIONS=0 rounds q / s to fp16 instead), heads padded to a power of two with zero
      weight. Each request's keys are gathered once from their pages (`common/index_pages.py`) into a contiguous FP8
      [keys, D] matrix + fp32 scales (~132 B a key: µs, against the GEMM's 8K FLOP a (token, key)), so the
      GEMM's tiles are 16-byte-aligned rows that cp.async streams into shared memory with no byte shuffles.
  scores: one program per (block of BT tokens of one request, run of TPP key tiles); swap-AB MMA
      acc[BS keys, BT x heads] = k8 @ q8^T (K = D in one dot), so a token's head sum stays inside a thread
      and its quad (DeepGEMM's sm90 layout); ReLU, the weights, the head sum and the key scale are the
      epilogue. Causal tile skipping: a program stops at its block's last position; blocks whose tokens all
      see at most topk keys are skipped (the selection takes every key without reading a score).
  workspace: scores of a chunk of tokens at a time, [chunk, keys rounded up to BS] fp32 (`chunk_tokens`: at
      most WS_BUDGET bytes, LONG_WS_BUDGET for the radix select's long rows), so the [tokens x context] matrix
      is never in HBM at once. The chunks' block tables reach the device in one copy that does not sync.
  selection ("select"): "rows", `triton_indexer._topk_select_kernel`, one program a row (the row in
      registers up to ROW_IN_REGS_MAX keys, counting passes over L2 past that); "radix",
      `triton_indexer_long.long_row_select` (4 radix rounds + count + write, split over radix_chunk-key
      programs; config "window": its window pass before round 0); "auto" (default): rows while a row fits in
      registers, radix past that. Each is the exact top-k of the workspace, ties in position order, slots in
      position order, -1 padded; neither reads a column past the row's position (the workspace is not written
      there).
Output equals the reference's selection but for near-ties at the k-th score that q's rounding parts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.common import envs, index_pages
from dsaserve.common.host_lists import to_device
from dsaserve.common.kv_layout import FP8_DS_MLA, KVLayout, get_kv_layout
from dsaserve.kernels import triton_indexer, triton_indexer_long
from dsaserve.kernels.triton_indexer_paged import fp8_q_scale, quant_q
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

# bytes of fp32 scores per chunk: 64 MB stays near the L2 between the score GEMM and the one-program row select
# (H200 sweep 2026-12-01: the full path at 8K x 8K 2.56 ms with 64 MB against 3.54 with 256). Rows past
# ROW_IN_REGS_MAX (the split radix select) take 128 MB: half the chunks, so half the launches and the select's
# tails (H200, 2026-12-01: full path 4K x 32K 3.99-4.15 ms against 4.97 with 64 MB, 16K x 128K 54.5-55.1
# against 57.3; the slice's 128K prefill 2.163-2.176 s against 2.262; 256 MB 2.153 s)
WS_BUDGET = 64 << 20
LONG_WS_BUDGET = 128 << 20
# sm_90 offline (ptxas -v): no spills; bench/sweep_indexer_prefill.py picks the measured best
# select "auto": the one-program row select (`triton_indexer._topk_select_kernel`) while a row fits in its
# registers (H200, 8K x 8K: 1.17 ms against the radix's 2.3 ms), the split radix select past that
# H200 sweep (2026-12-01, bench/RESULTS.md): scores 4 tokens x 64 keys, 16 tiles a program, 4 stages were the
# fastest at 8K / 32K / 128K context (345 / 696 / 729 TFLOP/s); radix chunks of 2048 columns beat 4096 / 8192
DEFAULT_CONFIG = {"bt": 4, "bs": 64, "tpp": 16, "num_warps": 4, "num_stages": 4, "select": "auto",
                  "radix_chunk": 2048, "window": triton_indexer_long.WINDOW_PASS}
SELECTS = ("auto", "radix", "rows")
HEAD_DIMS = (32, 64, 128)


def supported(layout: KVLayout, head_dim: int) -> bool:
    """FP8 keys (D bytes + one fp32 scale a key) and a head dim the MMA takes in one dot."""
    return layout.plain_dtype is None and head_dim in HEAD_DIMS


@triton.jit(do_not_specialize=["tok0", "n_tok"])
def _score_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, kbase_ptr, req_ptr, pos_ptr, blk_ptr, out_ptr, tok0, n_tok,
                  skip_below, stride_o, HP: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, BS: tl.constexpr,
                  TPP: tl.constexpr, Q_FP8: tl.constexpr, PDL: tl.constexpr = False):
    """Scores of BT tokens (one request) x TPP tiles of BS keys -> out[token - tok0, key] (fp32)."""
    grid_dependency_sync(PDL)
    t0 = tl.load(blk_ptr + tl.program_id(0))
    rows = t0 + tl.arange(0, BT)
    req = tl.load(req_ptr + t0)
    rmask = rows < n_tok
    rmask = rmask & (tl.load(req_ptr + rows, mask=rmask, other=-1) == req)
    last = tl.max(tl.load(pos_ptr + rows, mask=rmask, other=-1), axis=0)  # the block's last visible key
    j_first = tl.program_id(1) * (TPP * BS)
    if (last < skip_below) | (j_first > last):
        return
    n = tl.arange(0, BT * HP)  # MMA column n = (token n // HP, head n % HP)
    qrow = (t0 + n // HP).to(tl.int64) * HP + n % HP
    d = tl.arange(0, D)
    qmask = (t0 + n // HP) < n_tok
    # typed pointers, not bitcast values: the MMA then reads both operands straight from shared memory
    if Q_FP8:
        q_ptr = q_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    else:
        q_ptr = q_ptr.to(tl.pointer_type(tl.float16), bitcast=True)
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=qmask[:, None], other=0.0)
    w = tl.load(w_ptr + qrow, mask=qmask, other=0.0)
    k_ptr = k_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    kb = tl.load(kbase_ptr + req)
    out_rows = out_ptr + (rows - tok0).to(tl.int64) * stride_o
    j_end = tl.minimum(j_first + TPP * BS, last + 1)
    for j0 in tl.range(j_first, j_end, BS):
        j = j0 + tl.arange(0, BS)
        jmask = j <= last
        kt = tl.load(k_ptr + (kb + j).to(tl.int64)[:, None] * D + d[None, :], mask=jmask[:, None], other=0.0)
        if not Q_FP8:
            kt = kt.to(tl.float16)
        acc = tl.dot(kt, tl.trans(q))  # [BS, BT * HP], fp32
        s = tl.sum(tl.reshape(tl.maximum(acc, 0.0) * w[None, :], [BS, BT, HP]), axis=2)
        s = s * tl.load(ks_ptr + kb + j, mask=jmask, other=1.0)[:, None]
        tl.store(out_rows[None, :] + j[:, None], s, mask=jmask[:, None] & rmask[None, :])


@triton.jit
def _prepare_q_kernel(q_ptr, w_ptr, qo_ptr, wo_ptr, H, stride_qt, stride_qh, stride_wt, HP: tl.constexpr,
                      D: tl.constexpr, Q_FP8: tl.constexpr, PDL: tl.constexpr = False):
    """Token t's q / s (e4m3 or fp16) and w * s, s = amax / 448 per head, as torch's formula rounds them on a GPU
    (s = amax x fp32(1/448), then an IEEE division, round-to-nearest casts): one pass over q instead of torch's
    seven (2026-12-02, H200 128K prefill: ~23 ms of float / abs / amax / clamp / div / cast / fill kernels)."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    hm = h < H
    x = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=hm[:, None], other=0.0)
    x = x.to(tl.float32)
    s = fp8_q_scale(tl.max(tl.abs(x), axis=1))  # bit for bit the old torch path on a GPU
    y = quant_q(x, s[:, None], Q_FP8)  # padded heads: 0 / s = 0
    tl.store(qo_ptr + t * HP * D + h[:, None] * D + d[None, :], y)
    w = tl.load(w_ptr + t * stride_wt + h, mask=hm, other=0.0).to(tl.float32)
    tl.store(wo_ptr + t * HP + h, w * s)  # padded heads: weight 0


def prepare_q(q: torch.Tensor, head_weights: torch.Tensor, q_fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q / s as e4m3 bytes or fp16 bits [T, HP, D], w * s fp32 [T, HP]) with s = amax / 448 per (token, head)
    and the heads padded to a power of two (zero q, zero weight)."""
    t, h, d = q.shape
    hp = triton.next_power_of_2(h)
    qo = torch.empty((t, hp, d), dtype=torch.float8_e4m3fn if q_fp8 else torch.float16, device=q.device)
    wo = torch.empty((t, hp), dtype=torch.float32, device=q.device)
    if t:
        if q.stride(2) != 1 or head_weights.stride(1) != 1 or d & (d - 1):
            raise ValueError(f"prepare_q: q {tuple(q.shape)} strides {q.stride()} / head weights strides "
                             f"{head_weights.stride()}: expected a unit last stride and a power-of-two head dim")
        _prepare_q_kernel[(t,)](q, head_weights, qo, wo, h, q.stride(0), q.stride(1), head_weights.stride(0),
                                HP=hp, D=d, Q_FP8=q_fp8, num_warps=4, **pdl_args(q.device))
    return qo.view(torch.uint8 if q_fp8 else torch.int16), wo


def gather_keys(index_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: list[int], extend_lens: list[int],
                page_size: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(keys [n, D] uint8 (e4m3 bytes), scales [n] fp32, base [requests] int64): request r's key j is row
    base[r] + j. Requests with no new token gather nothing."""
    dev = index_cache.device
    index_pages.page_size_of(index_cache, FP8_DS_MLA, d, "gather_keys", expect=page_size)
    lens = [s if e else 0 for s, e in zip(seq_lens, extend_lens, strict=True)]
    base = [0]
    for n in lens[:-1]:
        base.append(base[-1] + n)
    total = base[-1] + lens[-1]
    lens_t = to_device(lens, torch.int64, dev)
    base_t = to_device(base, torch.int64, dev)
    req_of = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t, output_size=total)
    j = torch.arange(total, device=dev) - base_t[req_of]
    keys, scales = index_pages.key_views(index_cache, FP8_DS_MLA, d)
    page, off = page_table[req_of, j // page_size], j % page_size
    return keys[page, off], scales[page, off], base_t


def _blocks(seq_lens: list[int], extend_lens: list[int], tok0: int, tok1: int, bt: int) -> list[int]:
    """First token of every block of <= bt tokens of one request inside [tok0, tok1), the longest key sweep
    first (causal: the last blocks of a long request see the most keys)."""
    out, tok = [], 0
    for s, e in zip(seq_lens, extend_lens, strict=True):
        a, b = max(tok, tok0), min(tok + e, tok1)
        out += [(s - e + (min(i + bt, b) - tok) - 1, i) for i in range(a, b, bt)]
        tok += e
    return [t for _, t in sorted(out, reverse=True)]


def chunk_tokens(n_cols: int, conf: dict) -> int:
    """Tokens a workspace chunk of n_cols fp32 scores a row holds: conf's ws_budget, else WS_BUDGET while the row
    select takes the rows and LONG_WS_BUDGET past that; a multiple of 16 (at least one block of bt tokens)."""
    long_rows = conf["select"] == "radix" or (conf["select"] == "auto" and n_cols > triton_indexer.ROW_IN_REGS_MAX)
    budget = conf.get("ws_budget", LONG_WS_BUDGET if long_rows else WS_BUDGET)
    return max(conf["bt"], budget // (4 * n_cols) // 16 * 16)


def _config(config: dict | None) -> dict:
    conf = {**DEFAULT_CONFIG, **(config or {})}
    if conf["select"] not in SELECTS:
        raise ValueError(f"gemm_topk: select {conf['select']!r}: expected one of {SELECTS}")
    return conf


def block_tables(seq_lens: list[int], extend_lens: list[int], bounds: list[tuple[int, int]], bt: int,
                 device: torch.device) -> list[torch.Tensor]:
    """`_blocks` of every chunk [tok0, tok1) in bounds, as views of one device tensor: one host-to-device copy
    for the whole prefill, queued without a sync (`to_device`). A synchronous copy per chunk (1,024 chunks a
    layer at 128K) made the GPU idle while the host launched each next chunk."""
    lists = [_blocks(seq_lens, extend_lens, t0, t1, bt) for t0, t1 in bounds]
    flat = to_device([s for starts in lists for s in starts], torch.int32, device)
    return list(flat.split([len(starts) for starts in lists]))


def chunk_scores(ops: tuple, req_index: torch.Tensor, positions: torch.Tensor, seq_lens: list[int],
                 extend_lens: list[int], tok0: int, tok1: int, out: torch.Tensor, skip_below: int,
                 conf: dict, blk: torch.Tensor | None = None) -> None:
    """Scores of tokens [tok0, tok1) into out[:tok1 - tok0, :] (rows of tokens that see <= skip_below keys,
    and every column past a token's position, are left unwritten). ops = (q, w, keys, scales, base);
    blk: this chunk's `block_tables` entry (built here, for this chunk alone, when None)."""
    q, w, keys, scales, base = ops
    bt, bs, tpp = conf["bt"], conf["bs"], conf["tpp"]
    if blk is None:
        blk = block_tables(seq_lens, extend_lens, [(tok0, tok1)], bt, q.device)[0]
    if blk.numel() == 0:
        return
    grid = (blk.numel(), triton.cdiv(out.shape[1], tpp * bs))
    _score_kernel[grid](q, w, keys, scales, base, req_index, positions, blk, out, tok0, tok1, skip_below,
                        out.stride(0), HP=q.shape[1], D=q.shape[2], BT=bt, BS=bs, TPP=tpp,
                        Q_FP8=q.dtype == torch.uint8, num_warps=conf["num_warps"], num_stages=conf["num_stages"],
                        **pdl_args(q.device))


def _select(scores: torch.Tensor, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
            out: torch.Tensor, topk: int, page_size: int, how: str, radix_chunk: int = triton_indexer_long.CHUNK,
            window: bool = triton_indexer_long.WINDOW_PASS) -> None:
    """out <- the top-k slots of every workspace row (columns past a row's position are not read: unwritten)."""
    n_cols = scores.shape[1]
    if how == "auto":
        how = "rows" if n_cols <= triton_indexer.ROW_IN_REGS_MAX else "radix"
    if how == "radix":
        # positions, then one launch to slots, whatever a workspace chunk's rows: the last chunk of a prefill
        # can hold a few, and a variant chosen by its row count compiled after Up on the H200 (2026-12-02)
        triton_indexer_long.long_row_select(scores, page_table, req_index, positions, out, topk, page_size,
                                            chunk=radix_chunk, window=window, late_slots=True)
        return
    # one program a row: in registers up to ROW_IN_REGS_MAX keys, counting passes over L2 past that
    grid, args, kwargs = triton_indexer.row_select_launch(scores, page_table, req_index, positions, out, n_cols,
                                                          topk, page_size)
    triton_indexer._topk_select_kernel[grid](*args, **kwargs)


def gemm_topk(q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor, layout: KVLayout | str,
              page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, topk: int,
              page_size: int, seq_lens: list[int] | None = None, extend_lens: list[int] | None = None,
              q_fp8: bool | None = None, config: dict | None = None) -> torch.Tensor:
    """`reference.indexer_topk` for FP8 index keys (`supported`) -> [T, topk] int64 slots in position order,
    -1 padded. q_fp8: None follows DSASERVE_FP8_ACTIVATIONS. config: DEFAULT_CONFIG's keys, plus ws_budget."""
    t, _, d = q.shape
    layout = get_kv_layout(layout, "gemm_topk: layout")
    if not supported(layout, d):
        raise ValueError(f"gemm_topk: layout {layout} / head dim {d} not supported (FP8 keys, {HEAD_DIMS})")
    conf = _config(config)
    out = torch.empty((t, topk), dtype=torch.int64, device=q.device)
    if t == 0:
        return out
    if seq_lens is None or extend_lens is None:
        from dsaserve.kernels.triton_indexer_prefill import _host_lens
        seq_lens, extend_lens = _host_lens(req_index, positions)
    q_fp8 = envs.DSASERVE_FP8_ACTIVATIONS != "0" if q_fp8 is None else q_fp8
    ops = (*prepare_q(q, head_weights, q_fp8), *gather_keys(index_cache, page_table, seq_lens, extend_lens,
                                                            page_size, d))
    n_cols = triton.cdiv(max(max(seq_lens), 1), conf["bs"]) * conf["bs"]
    step = chunk_tokens(n_cols, conf)
    ws = torch.empty((min(step, t), n_cols), dtype=torch.float32, device=q.device)
    bounds = [(t0, min(t, t0 + step)) for t0 in range(0, t, step)]
    for (t0, t1), blk in zip(bounds, block_tables(seq_lens, extend_lens, bounds, conf["bt"], q.device), strict=True):
        chunk_scores(ops, req_index, positions, seq_lens, extend_lens, t0, t1, ws, topk, conf, blk)
        _select(ws[:t1 - t0], page_table, req_index[t0:t1], positions[t0:t1], out[t0:t1], topk, page_size,
                conf["select"], conf["radix_chunk"], conf["window"])
    return out
