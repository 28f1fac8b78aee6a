"""Index scores over the page-major FP8 indexer cache (request path stage 6, full indexer layers): the decode
score kernel and the addressing every FP8 indexer-cache kernel shares (`common/index_pages.py` is the layout).

Owns: `paged_index_scores` (`triton_indexer.index_scores` for the FP8 layouts), `score_tile`, `q_meta`, and the
jit helpers `page_split` (a key's page-table column and offset), `key_place` (its byte offset and its scale's
index), `fp8_q_scale` and `quant_q` (q's FP8 rounding, shared with the prefill kernels), `rounded_q` (`q_rows`,
then `round_q`) and `score_tiles` (the kernel's body, shared with the fused score + select launch,
`triton_indexer_coop`), and `chunk_scores` (that launch's chunk scored in registers).
The kernel: `blocks`-tile programs over the page table's width for each token, which share the tiles of the token's
own keys (`row_run`: the work follows the position, not the width a graph was captured at). It rounds the token's q
to e4m3 with one s = amax / 448 a head, folded into the head weight (`triton_indexer_gemm`'s rule, DeepGEMM's
fp8_mqa_logits; DSASERVE_FP8_ACTIVATIONS=0 rounds q / s to fp16 and widens the keys to fp16 exactly), then
loops over its tiles: the tile's keys are 16-byte-aligned rows of their pages, loaded straight into shared
memory by the pipelined loop (cp.async, `num_stages` tiles in flight), and one swap-AB MMA
acc[BS keys, heads] = k8 @ q8^T gives every head's dot at once; ReLU, the weights, the head sum and the key
scale are the epilogue. Keys past the token's position (causal) or past the page table are never read: -inf, or
left unwritten where the caller's select reads none of them (`fill`).
The decode kernels (this one and the fused score + select) take the page size as a constexpr, so a key's page and
offset are a shift and a mask: a runtime page size made each key's place an int64 division (a 64-bit check, then
~20 instructions with a reciprocal), 62 % of the scoring loop's stall samples and 21 % of the fused launch's
(Nsight Compute, H100); with the shift one row of 32K keys selects in 18.2 µs, not 20.9, and batch 128 at 32K
steps 0.50 ms faster (bench/RESULTS.md, forty-fourth session). A deployment has one page size: one variant.
Why a loop of tiles, not one tile a program: a program then keeps `num_stages` tiles of HBM reads in flight
while it multiplies, and q is rounded once per run; the row-layout kernel held one 512-key tile a program at
254 registers and read its 4-byte-aligned rows at ~0.9 TB/s (bench/RESULTS.md, twentieth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.common import envs
from dsaserve.common.index_pages import page_size_of
from dsaserve.kernels.triton_fp8_gemm import _sm_count
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args

# tile: BS keys (the MMA's M: 64 a warpgroup), warps, stages; programs of `blocks` tiles, PROGRAMS_PER_SM
# programs an SM over the batch's rows, at least MIN_BLOCKS tiles each. H200 sweep (2026-12-03, twenty-first
# session, graph-timed, each call over its own pages): 128 keys / 8 warps / 3 stages best or within 1 % of it
# everywhere; the best tiles a program 2 at 1 x 32K / 1 x 128K (6.9 / 13.7 us), 4 at 2 x 128K / 8 x 32K
# (21.0 / 20.9 us), 16 at 32 x 32K / 128 x 8K (63.4 / 63.3 us: 2.2 TB/s), which this rule gives
DEFAULT_TILE = {"bs": 128, "num_warps": 8, "num_stages": 3}
PROGRAMS_PER_SM = 4
MIN_BLOCKS = 2
_MIN_RUN = tl.constexpr(MIN_BLOCKS)


@triton.jit
def fp8_q_scale(amax):
    """The indexer q's FP8 scale amax / 448 as torch computes it on a GPU: amax x fp32(1 / 448) (a division by a
    Python scalar is a multiply by its fp32 reciprocal there), amax floored at 1e-12."""
    return tl.maximum(amax, 1e-12) * (1.0 / 448.0)


@triton.jit
def quant_q(x, s, Q_FP8: tl.constexpr):
    """q / s (s broadcast to x) as e4m3, or fp16 (the bf16 input to 2^-12, in fp16's range whatever q's
    magnitude): an IEEE division (Triton's `/` is approximate, so a q next to a rounding boundary could land on
    either side of it), clamped to +-448, round-to-nearest casts."""
    y = tl.minimum(tl.maximum(tl.div_rn(x, s), -448.0), 448.0)
    if Q_FP8:
        op = y.to(tl.float8e4nv)
    else:
        op = y.to(tl.float16)
    return op


@triton.jit
def page_split(j, page_size):
    """(page-table column, offset in the page) of key positions j >= 0, divided as uint32: no sign fix-ups, and an
    int64 j's division is a 64-bit check and a call (SASS, sm_90); a shift and a mask where page_size is a
    constexpr."""
    ju = j.to(tl.uint32)
    ps = (tl.zeros([], dtype=tl.int32) + page_size).to(tl.uint32)  # a tensor also when Triton fixed it at 1
    return ju // ps, (ju % ps).to(tl.int32)


@triton.jit
def key_place(pt_row, j, mask, page_size, page_bytes, D):
    """(byte offset of key position j's D e4m3 values, float32 index of its scale) through one request's
    page-table row, in the page-major cache: a page is page_size keys of D bytes, then their FP32 scales."""
    col, off = page_split(j, page_size)
    page = tl.load(pt_row + col, mask=mask, other=0).to(tl.int64)
    return page * page_bytes + off * D, page * (page_bytes // 4) + (page_size * D) // 4 + off


@triton.jit
def rounded_q(q_ptr, w_ptr, t, n_heads, head_dim, stride_qt, stride_qh, stride_wt, HP: tl.constexpr,
              BLOCK_D: tl.constexpr, Q_FP8: tl.constexpr):
    """(token t's q [HP, BLOCK_D] rounded to e4m3 (fp16 without Q_FP8) with one scale a head, its head weights
    [HP] fp32 with that scale folded in); padded heads and dims are 0."""
    x, w = q_rows(q_ptr, w_ptr, t, n_heads, head_dim, stride_qt, stride_qh, stride_wt, HP, BLOCK_D)
    return round_q(x, w, Q_FP8)


@triton.jit
def q_rows(q_ptr, w_ptr, t, n_heads, head_dim, stride_qt, stride_qh, stride_wt, HP: tl.constexpr,
           BLOCK_D: tl.constexpr):
    """`rounded_q`'s loads: token t's q [HP, BLOCK_D] and head weights [HP] as stored (padding 0)."""
    h = tl.arange(0, HP)
    hm = h < n_heads
    d = tl.arange(0, BLOCK_D)
    x = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=hm[:, None] & (d < head_dim)[None, :], other=0.0)
    return x, tl.load(w_ptr + t * stride_wt + h, mask=hm, other=0.0)


@triton.jit
def round_q(x, w, Q_FP8: tl.constexpr):
    """`rounded_q`'s numbers from its loads (`q_rows`)."""
    x = x.to(tl.float32)
    s = fp8_q_scale(tl.max(tl.abs(x), axis=1))
    q = quant_q(x, s[:, None], Q_FP8)  # padded heads: 0 / s = 0
    return q, w.to(tl.float32) * s  # padded heads: weight 0


@triton.jit
def score_tiles(q, w, k_ptr, ks_ptr, pt_row, out_row, j0, n_run, end, page_size, page_bytes, head_dim,
                BLOCK_D: tl.constexpr, BS: tl.constexpr, Q_FP8: tl.constexpr):
    """out_row[j] for keys j of the n_run BS-key tiles from j0 (-inf from `end` on, those keys never read): each
    tile's keys straight from their pages, one MMA acc[BS keys, heads] = k8 @ q^T, then ReLU, the weights, the
    head sum and the key's scale."""
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    k8 = k_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    for b in range(n_run):
        j = (j0 + b * BS + tl.arange(0, BS)).to(tl.int32)  # (b is int64 where end is: a position's type)
        valid = j < end
        kbyte, sidx = key_place(pt_row, j, valid, page_size, page_bytes, head_dim)
        k = tl.load(k8 + kbyte[:, None] + d[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
        if not Q_FP8:
            k = k.to(tl.float16)
        acc = tl.dot(k, tl.trans(q))  # [BS keys, HP heads], fp32
        score = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)
        score = score * tl.load(ks_ptr + sidx, mask=valid, other=1.0)
        tl.store(out_row + j, tl.where(valid, score, float("-inf")))


@triton.jit
def chunk_scores(q_raw, w_raw, k_ptr, ks_ptr, pt_row, j0, end, head_dim, page_size, page_bytes,
                 BLOCK_D: tl.constexpr, Q_FP8: tl.constexpr, CHUNK: tl.constexpr):
    """(visible, scores: -inf from `end` on) of the CHUNK keys from j0 in registers (`triton_indexer_coop.KEYS_FIRST`),
    given the token's q and head weights as loaded (`q_rows`, asked of memory with the program's role, so their
    latency passes under the page table's): the keys' bytes and scales asked for before q is rounded, then one MMA
    over the whole chunk (`score_tiles`' numbers: each key's dot, ReLU, weights and head sum are its own). The scores
    leave in a blocked layout (the `tl.gather` by position: one exchange), not the MMA's row slice, where each thread
    held 4 keys, each held by 4 threads, so every round's histogram and compares did 4x the work (sm_90 TTGIR: the
    slice layout reached each `tt.histogram`)."""
    d = tl.arange(0, BLOCK_D)
    j = (j0 + tl.arange(0, CHUNK)).to(tl.int32)
    vis = j < end
    kbyte, sidx = key_place(pt_row, j, vis, page_size, page_bytes, head_dim)
    k8 = k_ptr.to(tl.pointer_type(tl.float8e4nv), bitcast=True)
    keys = tl.load(k8 + kbyte[:, None] + d[None, :], mask=vis[:, None] & (d < head_dim)[None, :], other=0.0)
    scale = tl.load(ks_ptr + sidx, mask=vis, other=1.0)
    q, w = round_q(q_raw, w_raw, Q_FP8)
    if not Q_FP8:
        keys = keys.to(tl.float16)
    acc = tl.dot(keys, tl.trans(q))  # [CHUNK keys, HP heads], fp32
    x = tl.where(vis, tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1) * scale, float("-inf"))
    j = (j0 + tl.arange(0, CHUNK)).to(tl.int32)  # made again, so its layout follows the gathered scores'
    return j < end, tl.gather(x, tl.arange(0, CHUNK), 0)


@triton.jit
def row_run(row_tiles, blocks):
    """Tiles a program of a row scores: the row's own tiles over the launch's programs a row, at least MIN_BLOCKS
    (`blocks` where it is fewer), never more than `blocks` (sized by the page table's width, `score_tile`). A
    decode graph fixes the grid for its width class; a row far shorter than the width left all its keys to its
    first programs: at 128 rows under a 128K-wide table a 32K row's 257 tiles went to two programs (207 and 50
    tiles) of its five, the scores of a full layer 360 µs against 207 with five of 52 (H100, bench/RESULTS.md,
    forty-fifth session). cdiv(row_tiles, programs) without an integer division (the audit keeps these kernels
    division-free, `bench/offline_spec_sass.py`): Triton's fp32 quotient is within two ulps, so for counts under
    2^22 its ceiling is the true one or one more, which the multiply takes back."""
    n_prog = tl.num_programs(1)
    tiles = row_tiles.to(tl.int32)
    run = tl.ceil(tiles.to(tl.float32) / n_prog.to(tl.float32)).to(tl.int32)
    run = tl.where((run - 1) * n_prog >= tiles, run - 1, run)
    return tl.maximum(run, tl.minimum(blocks, _MIN_RUN))


@triton.jit
def _paged_score_kernel(q_ptr, w_ptr, k_ptr, ks_ptr, pt_ptr, req_ptr, pos_ptr, out_ptr, n_heads, head_dim,
                        page_size: tl.constexpr, n_keys, skip_below, page_bytes, blocks, stride_qt, stride_qh,
                        stride_wt, stride_pt, stride_ot, HP: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr,
                        Q_FP8: tl.constexpr, PDL: tl.constexpr = False, FILL: tl.constexpr = True):
    """Token t's scores -> out[t, j] (fp32); n_keys = the page table's keys. The row's visible tiles are shared
    among its programs (`row_run`); with FILL, program p also writes -inf over the tiles of its static run
    [p x blocks, (p + 1) x blocks) wholly past the token's position."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    if pos < skip_below:  # the selection takes every visible key of this row without reading a score
        return
    out_row = out_ptr + t * stride_ot
    end = tl.minimum(pos + 1, n_keys)  # one past the last key this token sees
    row_tiles = tl.cdiv(end, BS)
    if FILL:
        f0 = tl.program_id(1) * blocks
        for b in range(tl.maximum(row_tiles - f0, 0), blocks):  # tiles wholly in the token's future
            tl.store(out_row + (f0 + b) * BS + tl.arange(0, BS), tl.full([BS], float("-inf"), tl.float32))
    run = row_run(row_tiles, blocks)
    j0 = tl.program_id(1) * run * BS
    n_run = tl.minimum(tl.maximum(tl.cdiv(end - j0, BS), 0), run)
    if n_run == 0:
        return
    q, w = rounded_q(q_ptr, w_ptr, t, n_heads, head_dim, stride_qt, stride_qh, stride_wt, HP, BLOCK_D, Q_FP8)
    pt_row = pt_ptr + tl.load(req_ptr + t).to(tl.int64) * stride_pt
    score_tiles(q, w, k_ptr, ks_ptr, pt_row, out_row, j0, n_run, end, page_size, page_bytes, head_dim, BLOCK_D, BS,
                Q_FP8)


def score_tile(q: torch.Tensor, n_keys: int, tile: dict | None = None) -> dict:
    """The launch's tile (DEFAULT_TILE, overridden by `tile`) and `blocks`, tiles a program: enough programs for
    PROGRAMS_PER_SM an SM over the batch's rows, at least MIN_BLOCKS tiles each (fewer only in a short row)."""
    t, conf = q.shape[0], {**DEFAULT_TILE, **(tile or {})}
    tiles = triton.cdiv(max(n_keys, 1), conf["bs"])
    if conf.get("blocks") is None:  # then the row's runs balanced: no run of padding tiles past its keys
        want = min(tiles, max(MIN_BLOCKS, triton.cdiv(t * tiles, PROGRAMS_PER_SM * _sm_count(q))))
        conf["blocks"] = triton.cdiv(tiles, triton.cdiv(tiles, want))
    return conf


def q_meta(index_cache: torch.Tensor, q: torch.Tensor, page_size: int, who: str, q_fp8: bool | None) -> dict:
    """The score tiles' q constexprs (HP, BLOCK_D, Q_FP8), the cache's page size and q's head dim checked."""
    n_heads, d = q.shape[1:]
    page_size_of(index_cache, "fp8_ds_mla", d, who, expect=page_size)
    if d % 16 or not 16 <= d <= 256:
        raise ValueError(f"{who}: head dim {d} is not a multiple of 16 in 16..256")
    return {"HP": max(16, triton.next_power_of_2(n_heads)), "BLOCK_D": triton.next_power_of_2(d),
            "Q_FP8": envs.DSASERVE_FP8_ACTIVATIONS != "0" if q_fp8 is None else q_fp8}


def paged_index_scores(q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor,
                       page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, page_size: int,
                       skip_below: int = 0, tile: dict | None = None, q_fp8: bool | None = None,
                       fill: bool = True) -> torch.Tensor:
    """[T, n_keys] fp32 causal index scores over the page-major FP8 cache uint8 [pages, page_size x (D + 4)]
    (-inf where not visible; rows whose position is below skip_below are left unwritten; without `fill` the
    tiles wholly past a row's position too: for selects that read no key past it). q [T, H, D] (D a multiple of
    16 up to 256), head_weights [T, H]. tile: `DEFAULT_TILE`'s keys and blocks (bench sweeps); q_fp8: None follows
    DSASERVE_FP8_ACTIVATIONS."""
    t, n_heads, d = q.shape
    meta = q_meta(index_cache, q, page_size, "index_scores", q_fp8)
    n_keys = page_table.shape[1] * page_size
    conf = score_tile(q, n_keys, tile)
    bs, blocks = conf["bs"], conf["blocks"]
    per = bs * blocks
    out = torch.empty(t, triton.cdiv(n_keys, per) * per, dtype=torch.float32, device=q.device)
    if t == 0:
        return out[:, :n_keys]
    q = q if q.stride(-1) == 1 else q.contiguous()
    _paged_score_kernel[(t, triton.cdiv(n_keys, per))](
        q, head_weights, index_cache, index_cache.view(torch.float32), page_table, req_index, positions, out,
        n_heads, d, page_size, n_keys, skip_below, index_cache.stride(0), blocks, q.stride(0), q.stride(1),
        head_weights.stride(0), page_table.stride(0), out.stride(0), BS=bs, num_warps=conf["num_warps"],
        num_stages=conf["num_stages"], FILL=fill, **meta, **pdl_args(q.device))
    return out[:, :n_keys]
