"""GPU sparse MLA for many tokens (prefill, decode batches >= 16): tensor-core tiles over the gathered top-k rows
(request path stage 6, attention).

Owns: `sparse_mla_attention`, the registry's op (this kernel from TC_MIN_TOKENS tokens on, `triton_sparse_mla`'s
split-K flash-decoding below), and `sparse_mla_attention_tc`, the same op as `reference.sparse_mla_attention`
(weight-absorbed: scores on the latent = kv_lora nope + rope; output the attention-weighted nope latent), after
FlashMLA's sparse kernels. One program takes one token, all its heads (<= 64, the MMA rows: every gathered KV
row feeds 64 of them), half of its output columns (`dv_split` 2; 1: all) and one split of its top-k. Per
BLOCK_K slots it
  gathers the rows (-1 = skip; 64-bit row offsets; the next tile's rows are prefetched into L2 meanwhile),
  dequantises the nope part once into two bf16 halves that serve both dots (fp8_ds_mla: scale per 128 applied
  on the tile; `e4m3_bf16` decodes FP8 with integer ops instead of sm_90's slow conversion path),
  scores S = Q_a C_a^T + Q_b C_b^T + Q_rope R^T in one accumulator chain (wgmma),
  runs an online softmax in fp32 / exp2 that rescales the accumulator only when a row's maximum grew by more
  than 2^RESCALE_LOG2 (FlashAttention-4's lazy rescale: P stays below 2^8, and the accumulator multiplies are
  skipped on most tiles), and accumulates P C over its own columns (the gathered rows are never reloaded).
Few tokens split the top-k over programs (flash-decoding), merged by `triton_sparse_mla`'s combine kernel.
Measured on an H200 (bench/RESULTS.md, 2026-11-30): with the integer FP8 decode (`bits`) the kernel's output is
wrong on the hardware (rel 0.34 on fp8_ds_mla), though `e4m3_bf16` alone decodes all 256 bytes exactly there
(its test passes): the fault is in how the kernel scales the decoded tiles, not found yet. With sm_90's conversion
this kernel is 0.92-1.00x the split-K kernel (107 vs 91 TFLOP/s at T=128 only with the wrong decode). So
the registry does not bind it; it stays for the sweep (the next step is a pipelined gather, e.g. cp.async
or TMA, which Triton 3.6 does not give us for row gathers on Hopper).
Configs: DEFAULT's comment; bench/sweep_sparse_mla_tc.py times them, bench/offline_sm90.py compiles them for
sm_90 without a GPU (registers, spills, shared memory, loop instructions).
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from dsaserve.common.kv_layout import FP8_DS_MLA, FP8_E4M3, QUANT_GROUP, KVLayout, get_kv_layout
from dsaserve.kernels import triton_sparse_mla
from dsaserve.kernels.triton_fp8_gemm import _sm_count
from dsaserve.kernels.triton_sparse_mla import LOG2E, _slots, combine_splits
from dsaserve.kernels.triton_utils import INTERPRET, grid_dependency_sync, pdl_args, prefetch_rows

TC_MIN_TOKENS = 16  # the dispatcher's switch-over (issue 17: prefill and decode batches >= 16)
# e4m3_bf16 (BITS) gives value * 2^-120; the nope scale is multiplied by 2^64, so FP8 tiles hold value * 2^-56
# (normal bf16 for any latent, |x| in 2^-70..2^60) and the scores / output are multiplied back by 2^56.
BITS_SHIFT = 56
_KEY_DOWN = tl.constexpr(2.0 ** -BITS_SHIFT)  # a BF16 rope brought to the FP8 nope tiles' scale
_SCALE_UP = tl.constexpr(2.0 ** (120 - BITS_SHIFT))  # what an FP8 value's scale is multiplied by
RESCALE_LOG2 = tl.constexpr(8.0)
MAX_GRID_Y = 65535  # CUDA's limit on grid axes 1 and 2
# 4 warps, 32-key tiles, each program half the output columns: ~104 KB of shared memory and <= 255 registers, so
# two programs share an SM and one's gathers / dequant / softmax overlap the other's MMAs (Triton has no warp
# specialisation on Hopper). 8 warps on all 512 columns (one program a token) runs S twice anyway (Triton gives
# a chained dot all warps along M = 64 rows: both warpgroups compute the same S) and spills (offline sm_90
# compile: ~140 local loads a tile); bench/sweep_sparse_mla_tc.py times both.
DEFAULT = {"block_k": 32, "num_warps": 4, "num_stages": 1, "dv_split": 2, "bits": False, "prefetch": True,
           "splits": None}
_LAYOUT = {"fp8_ds_mla": 0, "bf16": 1, "fp32": 1, "fp8_e4m3": 2}  # the kernel's LAYOUT constexpr

if INTERPRET:  # the interpreter has no inline asm and does bf16 arithmetic on the raw uint16

    @triton.jit
    def _e4m3_bits(x):
        b = x.to(tl.uint16)
        return (((b & 0x7F) << 4) | ((b & 0x80) << 8)).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _mul_bf16(a, b):  # the exact product in fp32, rounded once: what sm_90's bf16 multiply gives
        return (a.to(tl.float32) * b.to(tl.float32)).to(tl.bfloat16)

else:

    @triton.jit
    def _e4m3_bits(x):
        # 4 bytes -> 4 bf16 in 2 registers: prmt moves each byte to the high byte of a 16-bit half; the sign stays
        # at bit 15 and exponent+mantissa shift to bits 10..4 (bf16's low exponent bits): ~2 integer ops a value
        return tl.inline_asm_elementwise(
            "{ .reg .b32 z, t0, t1, u0, u1;\n"
            "mov.b32 z, 0;\n"
            "prmt.b32 t0, $2, z, 0x1404;\n"
            "prmt.b32 t1, $2, z, 0x3424;\n"
            "shr.b32 u0, t0, 4;\n and.b32 u0, u0, 0x07F007F0;\n and.b32 t0, t0, 0x80008000;\n or.b32 $0, t0, u0;\n"
            "shr.b32 u1, t1, 4;\n and.b32 u1, u1, 0x07F007F0;\n and.b32 t1, t1, 0x80008000;\n or.b32 $1, t1, u1;\n}",
            "=r,=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=4)

    @triton.jit
    def _mul_bf16(a, b):  # sm_90 multiplies bf16x2 natively (mul.bf16x2): one rounding
        return a * b


@triton.jit
def e4m3_bf16(x, BITS: tl.constexpr):
    """uint8 e4m3 bytes -> bf16, exact: with BITS the e4m3 exponent read as bf16's (value * 2^-120, subnormals
    included, NaN not kept: the cache never holds one); else Triton's own conversion (sm_90 has no direct
    e4m3 -> bf16 instruction; bench/sweep_sparse_mla_tc.py times both)."""
    if BITS:
        y = _e4m3_bits(x)
    else:
        y = x.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    return y


@triton.jit
def _gather_nope(c_ptr, row, valid, col0, stride_c, LAYOUT: tl.constexpr, DC: tl.constexpr, HW: tl.constexpr):
    """Raw nope columns [col0, col0 + HW) of the gathered rows, and their fp8_ds_mla scales [BLOCK_K, NGS]
    (a half narrower than 128 lies in one scale group). Row offsets in the cache view's elements."""
    base = c_ptr + row * stride_c
    offs = col0 + tl.arange(0, HW)
    if DC == 2 * HW:
        raw = tl.load(base[:, None] + offs[None, :], mask=valid[:, None], other=0)
    else:
        raw = tl.load(base[:, None] + offs[None, :], mask=valid[:, None] & (offs < DC)[None, :], other=0)
    g = col0 // 128 + tl.arange(0, (HW + 127) // 128)
    if LAYOUT == 0:  # FP32 scales after the DC nope bytes
        sc_ptr = (base + DC).to(tl.pointer_type(tl.float32))
        sc = tl.load(sc_ptr[:, None] + g[None, :], mask=valid[:, None] & (g * 128 < DC)[None, :], other=0.0)
    else:
        sc = tl.full([row.shape[0], (HW + 127) // 128], 1.0, tl.float32)
    return raw, sc


@triton.jit
def _gather_rope(c_ptr, row, valid, stride_c, LAYOUT: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """Raw rope part of the gathered rows [BLOCK_K, BLOCK_R]: BF16 after the fp8_ds_mla scales (addressed in
    bytes, so 16-byte loads stay possible), else the cache's type after the nope part."""
    base = c_ptr + row * stride_c
    offs = tl.arange(0, BLOCK_R)
    if LAYOUT == 0:
        base = (base + DC + 4 * ((DC + 127) // 128)).to(tl.pointer_type(tl.bfloat16))
    else:
        base = base + DC
    if DR == BLOCK_R:
        kr = tl.load(base[:, None] + offs[None, :], mask=valid[:, None], other=0)
    else:
        kr = tl.load(base[:, None] + offs[None, :], mask=valid[:, None] & (offs < DR)[None, :], other=0)
    return kr


@triton.jit
def _rope_bf16(raw, LAYOUT: tl.constexpr, BITS: tl.constexpr):
    """The rope tile as bf16 at the nope tiles' scale (value * 2^-56 with BITS on the FP8 layouts)."""
    if LAYOUT == 1:
        x = raw.to(tl.bfloat16)
    elif LAYOUT == 0:  # BF16 rope: the shift goes on the keys (a power of two) so Q stays a plain load
        x = raw
        if BITS:
            x = _mul_bf16(x, tl.full([1, 1], _KEY_DOWN, tl.bfloat16))
    else:
        x = e4m3_bf16(raw, BITS)
        if BITS:
            x = _mul_bf16(x, tl.full([1, 1], _SCALE_UP, tl.bfloat16))
    return x


@triton.jit
def _nope_bf16(raw, sc, LAYOUT: tl.constexpr, BITS: tl.constexpr, HW: tl.constexpr):
    """The gathered nope half as bf16 [BLOCK_K, HW], its scale applied (one rounding); value * 2^-56 with BITS."""
    if LAYOUT == 1:
        c = raw.to(tl.bfloat16)
    else:
        if BITS:
            sc = sc * _SCALE_UP
        grouped = tl.reshape(e4m3_bf16(raw, BITS), (raw.shape[0], (HW + 127) // 128, HW // ((HW + 127) // 128)))
        c = tl.reshape(_mul_bf16(grouped, sc.to(tl.bfloat16)[:, :, None]), (raw.shape[0], HW))
    return c


@triton.jit
def _store_out(o_ptr, acc, scale, sp, t, offs_h, hmask, col0, stride_os, stride_ot, stride_oh, DC: tl.constexpr,
               HW: tl.constexpr):
    offs = col0 + tl.arange(0, HW)
    ptrs = o_ptr + sp * stride_os + t * stride_ot + offs_h[:, None] * stride_oh + offs[None, :]
    tl.store(ptrs, (acc * scale[:, None]).to(o_ptr.dtype.element_ty), mask=hmask[:, None] & (offs < DC)[None, :])


@triton.jit
def _sparse_mla_tc_kernel(qn_ptr, qr_ptr, c_ptr, slot_ptr, o_ptr, lse_ptr, n_heads, n_keys, keys_per_split,
                          qk_scale, out_scale, stride_qnt, stride_qnh, stride_qrt, stride_qrh, stride_c, stride_st,
                          stride_os, stride_ot, stride_oh, stride_ls, stride_lt,
                          LAYOUT: tl.constexpr, DC: tl.constexpr, DR: tl.constexpr, ELEM: tl.constexpr,
                          ROW_BYTES: tl.constexpr, LINES: tl.constexpr, BITS: tl.constexpr, SPLIT: tl.constexpr,
                          DV_SPLIT: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_H: tl.constexpr, HW: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """The nope columns come in halves a, b of HW: both feed the scores; P @ half a (and P @ half b when
    DV_SPLIT is 1) accumulate. Halves keep the bf16 tile live in registers during the dequant small."""
    grid_dependency_sync(PDL)
    # the output halves of one token are neighbouring programs, so they run together and the second gather of
    # its rows hits L2
    hb = tl.program_id(0) // DV_SPLIT
    col_a = (tl.program_id(0) % DV_SPLIT) * HW  # DV_SPLIT 2: this program's output half
    t = tl.program_id(1).to(tl.int64)
    col_b = HW - col_a
    sp = tl.program_id(2)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs_h < n_heads
    offs_v = tl.arange(0, HW)
    offs_r = tl.arange(0, BLOCK_R)
    q_rows = qn_ptr + t * stride_qnt + offs_h[:, None] * stride_qnh
    qa = tl.load(q_rows + col_a + offs_v[None, :], mask=hmask[:, None] & (col_a + offs_v < DC)[None, :], other=0.0)
    qb = tl.load(q_rows + col_b + offs_v[None, :], mask=hmask[:, None] & (col_b + offs_v < DC)[None, :], other=0.0)
    qr = tl.load(qr_ptr + t * stride_qrt + offs_h[:, None] * stride_qrh + offs_r[None, :],
                 mask=hmask[:, None] & (offs_r < DR)[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)  # finite: a block of all-skipped slots gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_a = tl.zeros([BLOCK_H, HW], tl.float32)
    if DV_SPLIT == 1:
        acc_b = tl.zeros([BLOCK_H, HW], tl.float32)
    k0 = sp * keys_per_split
    k1 = tl.minimum(k0 + keys_per_split, n_keys)
    row_n, valid_n = _slots(slot_ptr, t, stride_st, k0, k1, BLOCK_K)
    for start in range(k0, k1, BLOCK_K):
        row, valid = row_n, valid_n
        row_n, valid_n = _slots(slot_ptr, t, stride_st, start + BLOCK_K, k1, BLOCK_K)
        if PREFETCH:  # the next tile's rows travel HBM -> L2 while this one computes
            prefetch_rows(c_ptr, row_n, stride_c, ELEM, ROW_BYTES, LINES)
        ra, sa = _gather_nope(c_ptr, row, valid, col_a, stride_c, LAYOUT, DC, HW)
        rb, sb = _gather_nope(c_ptr, row, valid, col_b, stride_c, LAYOUT, DC, HW)
        kr = _gather_rope(c_ptr, row, valid, stride_c, LAYOUT, DC, DR, BLOCK_R)
        ca = _nope_bf16(ra, sa, LAYOUT, BITS, HW)
        cb = _nope_bf16(rb, sb, LAYOUT, BITS, HW)
        s = tl.dot(qa, tl.trans(ca))
        s = tl.dot(qb, tl.trans(cb), s)
        s = tl.dot(qr, tl.trans(_rope_bf16(kr, LAYOUT, BITS)), s)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 units: qk_scale has log2(e)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if tl.max(m_new - m_i, axis=0) > RESCALE_LOG2:  # else keep the stale maximum: p <= 2^RESCALE_LOG2
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc_a = acc_a * alpha[:, None]
            if DV_SPLIT == 1:
                acc_b = acc_b * alpha[:, None]
            m_i = m_new
        p = tl.exp2(s - m_i[:, None])
        l_i += tl.sum(p, axis=1)
        p = p.to(tl.bfloat16)
        acc_a = tl.dot(p, ca, acc_a)
        if DV_SPLIT == 1:
            acc_b = tl.dot(p, cb, acc_b)
    scale = tl.where(l_i > 0, out_scale / l_i, 0.0)  # a token without slots gets zeros, not 0 * inf
    _store_out(o_ptr, acc_a, scale, sp, t, offs_h, hmask, col_a, stride_os, stride_ot, stride_oh, DC, HW)
    if DV_SPLIT == 1:
        _store_out(o_ptr, acc_b, scale, sp, t, offs_h, hmask, col_b, stride_os, stride_ot, stride_oh, DC, HW)
    if SPLIT:  # one lse per (token, head, split): the program of the first columns writes it
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + sp * stride_ls + t * stride_lt + offs_h, lse, mask=hmask & (offs_h * 0 + col_a == 0))


def _config(layout: KVLayout, config: dict | None) -> dict:
    cfg = dict(DEFAULT)
    cfg.update(config or {})
    if cfg["dv_split"] not in (1, 2):
        raise ValueError(f"sparse_mla_attention_tc: dv_split {cfg['dv_split']}, expected 1 or 2")
    cfg["bits"] = cfg["bits"] and layout.plain_dtype is None  # FP8 layouts only
    return cfg


def programs_per_sm(cfg: dict) -> int:
    """How many programs of `cfg` share an SM: two for 4 warps x 32-key tiles (offline sm_90 compile: 104 KB of
    shared memory, <= 255 registers of 128 threads), else one (the Q tile alone is 72 KB)."""
    return 2 if cfg["num_warps"] == 4 and cfg["block_k"] <= 32 else 1


def pick_splits(programs: int, n_keys: int, block_k: int, slots: int) -> int:
    """Top-k splits (flash-decoding) so the programs fill one wave of `slots` resident programs: each split costs
    a partial [T, H, kv_lora] fp32 write and read, so no more than that; each split keeps >= 2 key tiles."""
    if programs >= slots:
        return 1
    return max(1, min(slots // programs, n_keys // (2 * block_k)))


def _cache_view(kv_cache: torch.Tensor, layout: KVLayout, dc: int, dr: int) -> tuple[torch.Tensor, int]:
    """(the view the kernel reads rows from, its element bytes): uint8 rows for the FP8 layouts (the fp8_ds_mla
    scales and rope addressed in bytes), typed rows for bf16 / fp32."""
    row_bytes = layout.kv_bytes_per_token(SimpleNamespace(kv_lora_rank=dc, qk_rope_head_dim=dr, index_head_dim=0))
    if kv_cache.shape[-1] * kv_cache.element_size() != row_bytes:
        raise ValueError(f"sparse_mla_attention: {layout.name} rows are {kv_cache.shape[-1] * kv_cache.element_size()}"
                         f" B, expected {row_bytes} for kv_lora_rank {dc}, rope {dr}")
    if layout == FP8_DS_MLA and dc % QUANT_GROUP:
        raise ValueError(f"sparse_mla_attention: fp8_ds_mla needs kv_lora_rank % {QUANT_GROUP} == 0, got {dc}")
    if layout in (FP8_DS_MLA, FP8_E4M3):
        return kv_cache.view(torch.uint8), 1
    view = kv_cache.view(getattr(torch, layout.plain_dtype))
    return view, view.element_size()


def _out_buffer(q_nope: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """The result's buffer: `out` checked (contiguous, q_nope's shape and dtype), or a new one."""
    if out is None:
        return torch.empty(q_nope.shape, dtype=q_nope.dtype, device=q_nope.device)
    if out.shape != q_nope.shape or out.dtype != q_nope.dtype or not out.is_contiguous():
        raise ValueError(f"sparse_mla_attention: out must be contiguous {tuple(q_nope.shape)} {q_nope.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    return out


def _split_partials(q_nope: torch.Tensor, out: torch.Tensor, topk_slots: torch.Tensor, splits: int, block_k: int):
    """(keys per split, splits, slots with unit stride, partials [splits, T, H, dc], lse [splits, T, H]) for
    `splits` requested top-k splits, each a whole number of key tiles (so fewer may be left). Unsplit, the
    partials are `out` itself and lse an unused view of it."""
    n_keys = topk_slots.shape[1]
    per_split = triton.cdiv(triton.cdiv(n_keys, splits), block_k) * block_k
    splits = max(1, triton.cdiv(n_keys, per_split))
    slots = topk_slots if topk_slots.stride(-1) == 1 else topk_slots.contiguous()
    part, lse = out.unsqueeze(0), out[:, :, 0].unsqueeze(0)  # lse unused when unsplit
    if splits > 1:
        t, h, dc = q_nope.shape
        part = torch.empty(splits, t, h, dc, dtype=torch.float32, device=q_nope.device)
        lse = torch.empty(splits, t, h, dtype=torch.float32, device=q_nope.device)
    return per_split, splits, slots, part, lse


def sparse_mla_attention_tc(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor,
                            layout: KVLayout | str, topk_slots: torch.Tensor, softmax_scale: float,
                            kv_lora_rank: int, out: torch.Tensor | None = None,
                            config: dict | None = None) -> torch.Tensor:
    """GPU `reference.sparse_mla_attention` -> [T, H, kv_lora_rank] in q_nope.dtype (tensor-core tiles; into
    `out`, contiguous, when given: the piecewise graphs' buffer).

    `config` (bench/tuning only) overrides DEFAULT: block_k, num_warps, num_stages, dv_split (1 or 2 programs
    per token's output columns), bits (the bit-level FP8 decode), prefetch (L2 prefetch of the next tile),
    splits (top-k splits; None: one wave of resident programs, `pick_splits`).
    """
    layout = get_kv_layout(layout, "sparse_mla_attention: layout")
    if q_nope.shape[-1] != kv_lora_rank:
        raise ValueError(f"sparse_mla_attention: q_nope has {q_nope.shape[-1]} channels, kv_lora_rank is "
                         f"{kv_lora_rank}")
    out = _out_buffer(q_nope, out)
    if out.shape[0] == 0:
        return out
    part, lse, launches, meta = launch_plan(q_nope, q_rope, kv_cache, layout, topk_slots, softmax_scale, out,
                                            _config(layout, config), _sm_count(q_nope))
    for grid, args in launches:
        _sparse_mla_tc_kernel[grid](*args, **meta, **pdl_args(q_nope.device))
    combine_splits(part, lse, out)
    return out


def launch_plan(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout,
                topk_slots: torch.Tensor, softmax_scale: float, out: torch.Tensor, cfg: dict, sms: int):
    """(partials [splits, T, H, dc], lse, [(grid, kernel args)], constexprs) of one call, nothing launched
    (bench/offline_sm90.py compiles from it). Unsplit, the partials are `out` itself."""
    t, h, dc = q_nope.shape
    dr = q_rope.shape[-1]
    view, elem = _cache_view(kv_cache, layout, dc, dr)
    bh, bk, dv = min(64, max(16, triton.next_power_of_2(h))), cfg["block_k"], cfg["dv_split"]
    n_keys = topk_slots.shape[1]
    grid1 = triton.cdiv(h, bh) * dv
    splits = cfg["splits"] or pick_splits(t * grid1, n_keys, bk, sms * programs_per_sm(cfg))
    per_split, splits, slots, part, lse = _split_partials(q_nope, out, topk_slots, splits, bk)
    shift = 2.0 ** BITS_SHIFT if cfg["bits"] else 1.0
    row_bytes = view.shape[-1] * elem
    meta = {"LAYOUT": _LAYOUT[layout.name], "DC": dc, "DR": dr, "ELEM": elem, "ROW_BYTES": row_bytes,
            "LINES": triton.next_power_of_2(row_bytes // 128 + 2), "BITS": cfg["bits"], "SPLIT": splits > 1,
            "DV_SPLIT": dv, "PREFETCH": cfg["prefetch"], "BLOCK_H": bh, "HW": triton.next_power_of_2(dc) // 2,
            "BLOCK_R": max(16, triton.next_power_of_2(dr)), "BLOCK_K": bk, "num_warps": cfg["num_warps"],
            "num_stages": cfg["num_stages"]}
    launches = []
    for i in range(0, t, MAX_GRID_Y):  # tokens on grid axis 1: at most 65535 a launch
        j = min(t, i + MAX_GRID_Y)
        launches.append(((grid1, j - i, splits), (
            q_nope[i:j], q_rope[i:j], view, slots[i:j], part[:, i:j], lse[:, i:j], h, n_keys, per_split,
            softmax_scale * LOG2E * shift, shift, q_nope.stride(0), q_nope.stride(1), q_rope.stride(0),
            q_rope.stride(1), view.stride(0), slots.stride(0), part.stride(0), part.stride(1), part.stride(2),
            lse.stride(0), lse.stride(1))))
    return part, lse, launches, meta


def sparse_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout | str,
                         topk_slots: torch.Tensor, softmax_scale: float, kv_lora_rank: int,
                         out: torch.Tensor | None = None, defer_combine: bool = False,
                         full_rows: bool = False) -> torch.Tensor:
    """The registry's sparse MLA: tensor-core tiles from TC_MIN_TOKENS tokens on (a step's token count is static
    under CUDA graphs, so each captured bucket keeps one kernel), `triton_sparse_mla`'s split-K flash-decoding
    below (a few tokens cannot fill the GPU with 64-row tiles; that kernel splits the top-k further)."""
    args = (q_nope, q_rope, kv_cache, layout, topk_slots, softmax_scale, kv_lora_rank)
    if q_nope.shape[0] >= TC_MIN_TOKENS:
        return sparse_mla_attention_tc(*args, out=out)  # merges its own splits: nothing to defer
    return triton_sparse_mla.sparse_mla_attention(*args, out=out, defer_combine=defer_combine, full_rows=full_rows)
