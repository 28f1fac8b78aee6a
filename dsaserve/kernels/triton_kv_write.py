"""GPU KV writes: fused `mla_kv_write`, `indexer_k_norm_write` and `indexer_k_write` (request path stage 6,
"norm+RoPE+KV write").

Owns: the GPU variants of `reference.mla_kv_write` (RMSNorm of the nope part, interleaved RoPE of the rope
part, the latent returned, and the row encoded into the paged cache at its slot: one Triton program per
token, one launch, nothing round-trips through memory) and of the indexer-key write (FP8 e4m3 + one FP32
scale per 128-value key, or plain bf16 / fp32 in the debugging layouts, at the slot's place in its page:
`common/index_pages.py`). Quantisation follows the codec of
`common/kv_layout.py` exactly: scale = max(amax, 1e-12) / 448, values clamped to +-448, round to nearest.
Slots < 0 are skipped, so padded rows of a captured decode batch write nothing. Both fused writes also take the
layer's queries and rotate them in place (`triton_elementwise._rope_heads`, bit for bit `rope_inplace`): a launch
fewer a layer for sparse MLA's q and a full layer's indexer q, each block of 16 heads a program of its own beside
the token's write program (grid (T, 1 + blocks)). The RoPE launches it replaced added 8.7 µs to the slice's batch-1
1K step, six of them (bench/RESULTS.md twenty-eighth session); the write's one program rotating the blocks in turn
first made each MLA write ~5 µs of an H100's batch-1 step (thirty-seventh session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.common import index_pages
from dsaserve.common.kv_layout import BF16, FP8_DS_MLA, FP8_E4M3, FP8_MAX, FP32, QUANT_GROUP, KVLayout, get_kv_layout
from dsaserve.kernels import triton_elementwise
from dsaserve.kernels.triton_elementwise import _rnd, _rope_heads, rope_heads_block
from dsaserve.kernels.triton_utils import grid_dependency_sync, opaque_index, pdl_args

_LAYOUT = {FP8_DS_MLA: 0, BF16: 1, FP32: 2, FP8_E4M3: 3}  # the kernels' LAYOUT constexpr
_INDEX_LAYOUT = {FP8_DS_MLA: 0, FP8_E4M3: 0, BF16: 1, FP32: 2}  # indexer keys: FP8 + scale, bf16, fp32
FP8_MAX_C = tl.constexpr(FP8_MAX)  # a plain float global is not visible inside @triton.jit
# q's RoPE blocks as programs of their own beside the write (False: the write's program rotates them in turn first;
# bench/profile_decode.py's "q_rope_serial")
Q_ROPE_PROGRAMS = True


@triton.jit
def _q_rope_role(q_ptr, t, n_heads, half, stride_qt, stride_qh, cos_row, sin_row, INTERLEAVED: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_QH: tl.constexpr, Q_PROGRAMS: tl.constexpr):
    """q's RoPE in a write kernel (`_rope_heads`, bit for bit `rope_inplace`), padded rows too. Q_PROGRAMS: this
    program (t, 1 + b) rotates head block b beside program (t, 0)'s write; else program (t, 0) rotates every
    block in turn before its write (each block's loads wait for the last block's stores: a batch-1 step's full
    layer paid ~3 µs more in the MLA write, bench/RESULTS.md thirty-seventh session)."""
    if Q_PROGRAMS:
        b = tl.program_id(1) - 1
        if b >= 0:
            _rope_heads(q_ptr, t, b * BLOCK_QH + tl.arange(0, BLOCK_QH), n_heads, half, stride_qt, stride_qh,
                        cos_row, sin_row, INTERLEAVED, BLOCK_P)
    else:
        for h0 in range(0, n_heads, BLOCK_QH):
            _rope_heads(q_ptr, t, h0 + tl.arange(0, BLOCK_QH), n_heads, half, stride_qt, stride_qh, cos_row,
                        sin_row, INTERLEAVED, BLOCK_P)


@triton.jit
def _mla_kv_write_kernel(a_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, lat_ptr, c8_ptr, c32_ptr, c16_ptr, eps,
                         dc, half, stride_a, stride_cos, stride_sin, stride_lat, stride_c8, stride_c32, stride_c16,
                         cs_off, r_off, q_ptr, n_heads, stride_qt, stride_qh, LAYOUT: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, NG: tl.constexpr, Q_ROPE: tl.constexpr,
                         BLOCK_QH: tl.constexpr, Q_PROGRAMS: tl.constexpr = False,
                         WEIGHT_FIRST: tl.constexpr = True, PDL: tl.constexpr = False):
    offs_c = tl.arange(0, BLOCK_C)
    cmask = offs_c < dc
    if WEIGHT_FIRST:  # no kernel writes the norm weight: read before the wait (`triton_elementwise.NORM_WEIGHT_FIRST`)
        w = tl.load(w_ptr + offs_c, mask=cmask, other=0.0).to(tl.float32)
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    if Q_ROPE:  # the token's q RoPE slice in place (`rope_inplace(q_rope, cos, sin, True)`)
        _q_rope_role(q_ptr, t, n_heads, half, stride_qt, stride_qh, cos_ptr + t * stride_cos,
                     sin_ptr + t * stride_sin, True, BLOCK_R, BLOCK_QH, Q_PROGRAMS)
    if tl.program_id(1) > 0:  # a program of q's head blocks only (Q_PROGRAMS)
        return
    x = tl.load(a_ptr + t * stride_a + offs_c, mask=cmask, other=0.0)
    xf = x.to(tl.float32)
    # HF RMSNorm: normalise in fp32, round to the input dtype, then scale by the weight
    y = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / dc + eps)).to(x.dtype).to(tl.float32)
    if not WEIGHT_FIRST:
        w = tl.load(w_ptr + offs_c, mask=cmask, other=0.0).to(tl.float32)
    nope = (y * w).to(lat_ptr.dtype.element_ty)
    offs_r = tl.arange(0, BLOCK_R)
    rmask = offs_r < half
    x1 = tl.load(a_ptr + t * stride_a + dc + 2 * offs_r, mask=rmask, other=0.0)
    x2 = tl.load(a_ptr + t * stride_a + dc + 2 * offs_r + 1, mask=rmask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_cos + offs_r, mask=rmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + t * stride_sin + offs_r, mask=rmask, other=0.0).to(tl.float32)
    r1 = (x1.to(tl.float32) * cos - x2 * sin).to(x1.dtype).to(lat_ptr.dtype.element_ty)
    r2 = (x2 * cos + x1.to(tl.float32) * sin).to(x1.dtype).to(lat_ptr.dtype.element_ty)
    lat_row = lat_ptr + t * stride_lat
    tl.store(lat_row + offs_c, nope, mask=cmask)
    tl.store(lat_row + dc + offs_r, r1, mask=rmask)
    tl.store(lat_row + dc + half + offs_r, r2, mask=rmask)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    slot = opaque_index(slot.to(tl.int64))
    nf = nope.to(tl.float32)
    if LAYOUT == 0:  # fp8_ds_mla: e4m3 nope, FP32 scale per 128, BF16 rope
        g = tl.reshape(nf, (NG, 128))
        scale = tl.maximum(tl.max(tl.abs(g), axis=1), 1e-12) / FP8_MAX_C
        q = tl.reshape(tl.clamp(g / scale[:, None], -FP8_MAX_C, FP8_MAX_C), (BLOCK_C,)).to(tl.float8e4nv)
        tl.store(c8_ptr + slot * stride_c8 + offs_c, q.to(tl.uint8, bitcast=True), mask=cmask)
        offs_g = tl.arange(0, NG)
        tl.store(c32_ptr + slot * stride_c32 + cs_off + offs_g, scale, mask=offs_g * 128 < dc)
        tl.store(c16_ptr + slot * stride_c16 + r_off + offs_r, r1.to(tl.bfloat16), mask=rmask)
        tl.store(c16_ptr + slot * stride_c16 + r_off + half + offs_r, r2.to(tl.bfloat16), mask=rmask)
    elif LAYOUT == 3:  # fp8_e4m3, per-tensor scale 1
        row = c8_ptr + slot * stride_c8
        tl.store(row + offs_c, tl.clamp(nf, -FP8_MAX_C, FP8_MAX_C).to(tl.float8e4nv).to(tl.uint8, bitcast=True),
                 mask=cmask)
        for_r1 = tl.clamp(r1.to(tl.float32), -FP8_MAX_C, FP8_MAX_C).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        for_r2 = tl.clamp(r2.to(tl.float32), -FP8_MAX_C, FP8_MAX_C).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(row + dc + offs_r, for_r1, mask=rmask)
        tl.store(row + dc + half + offs_r, for_r2, mask=rmask)
    else:  # plain bf16 (c16 view) / fp32 (c32 view)
        dst = c16_ptr if LAYOUT == 1 else c32_ptr
        stride = stride_c16 if LAYOUT == 1 else stride_c32
        row = dst + slot * stride
        tl.store(row + offs_c, nope.to(dst.dtype.element_ty), mask=cmask)
        tl.store(row + dc + offs_r, r1.to(dst.dtype.element_ty), mask=rmask)
        tl.store(row + dc + half + offs_r, r2.to(dst.dtype.element_ty), mask=rmask)


def _views(cache: torch.Tensor):
    return cache, cache.view(torch.float32), cache.view(torch.bfloat16)


def mla_kv_write(kv_cache: torch.Tensor, layout: KVLayout | str, slots: torch.Tensor, kv_a: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 kv_lora_rank: int, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    """GPU `reference.mla_kv_write` -> latent [T, kv_lora_rank + rope] (before quantisation); with q_rope
    [T, H, rope] (a view, unit last stride) its interleaved RoPE in place in the same launch."""
    layout = get_kv_layout(layout, "mla_kv_write: layout")
    t, width = kv_a.shape
    dc, dr = kv_lora_rank, width - kv_lora_rank
    q_args = _q_rope_args(q_rope, t, dr, kv_a, "mla_kv_write", exact=True)
    if layout == FP8_DS_MLA and dc % QUANT_GROUP:
        raise ValueError(f"mla_kv_write: fp8_ds_mla needs kv_lora_rank % {QUANT_GROUP} == 0, got {dc}")
    lat_dtype = torch.promote_types(norm_weight.dtype, kv_a.dtype)
    latent = torch.empty(t, width, dtype=lat_dtype, device=kv_a.device)
    if t == 0:
        return latent
    c8, c32, c16 = _views(kv_cache)
    block_c = triton.next_power_of_2(dc)
    kv_a = kv_a if kv_a.stride(-1) == 1 else kv_a.contiguous()
    _mla_kv_write_kernel[(t, 1 + q_args[5])](
        kv_a, norm_weight, cos, sin, slots, latent, c8, c32, c16, eps, dc, dr // 2, kv_a.stride(0), cos.stride(0),
        sin.stride(0), latent.stride(0), c8.stride(0), c32.stride(0), c16.stride(0), dc // 4,
        (dc + 4 * (dc // QUANT_GROUP)) // 2, *q_args[:4], LAYOUT=_LAYOUT[layout], BLOCK_C=block_c,
        BLOCK_R=triton.next_power_of_2(max(dr // 2, 1)), NG=max(1, block_c // QUANT_GROUP), Q_ROPE=q_rope is not None,
        BLOCK_QH=q_args[4], Q_PROGRAMS=q_args[5] > 0, WEIGHT_FIRST=triton_elementwise.NORM_WEIGHT_FIRST, num_warps=4,
        **pdl_args(kv_a.device))
    return latent


def _q_rope_args(q: torch.Tensor | None, t: int, rope: int, dummy: torch.Tensor, who: str,
                 exact: bool = False) -> tuple:
    """(q, heads, token stride, head stride, heads a block, programs a token for q's blocks: 0 where program
    (t, 0) rotates them itself) for a write kernel's fused q RoPE (dummy's when q is None); q [T, H, rope]
    (`exact`: sparse MLA's RoPE slice) or [T, H, >= rope] (the indexer's heads, whose first `rope` values rotate),
    with a unit last stride."""
    if q is None:
        return dummy, 0, 0, 0, 1, 0
    fits = q.dim() == 3 and q.shape[0] == t and (q.shape[2] == rope if exact else q.shape[2] >= rope)
    if not fits or q.stride(2) != 1:
        raise ValueError(f"{who}: q must be [{t}, heads, {'' if exact else '>= '}{rope}] with a unit last stride, "
                         f"got {tuple(q.shape)} strides {q.stride()}")
    block = rope_heads_block(q.shape[1])
    return q, q.shape[1], q.stride(0), q.stride(1), block, triton.cdiv(q.shape[1], block) if Q_ROPE_PROGRAMS else 0


@triton.jit
def _key_at(slot, page_size, page_bytes, key_bytes):
    """(byte offset of the slot's key values, its FP32 scale's index) in the page-major indexer cache
    (`common/index_pages.py`: a page's keys of key_bytes each, then their scales)."""
    page = slot // page_size
    off = slot - page * page_size
    return page * page_bytes + off * key_bytes, (page * page_bytes + page_size * key_bytes) // 4 + off


@triton.jit
def _store_key(c8_ptr, c32_ptr, c16_ptr, kbyte, v, cols, mask, scale, LAYOUT: tl.constexpr):
    """Values v (fp32) at columns `cols` of an indexer key whose values start at byte kbyte: LAYOUT 0 e4m3 of
    v / scale (the key's one FP32 scale, KVLayout.encode_index_k; the caller stores it), 1 bf16, 2 fp32."""
    if LAYOUT == 0:
        q = tl.clamp(v / scale, -FP8_MAX_C, FP8_MAX_C).to(tl.float8e4nv)
        tl.store(c8_ptr + kbyte + cols, q.to(tl.uint8, bitcast=True), mask=mask)
    elif LAYOUT == 1:
        tl.store(c16_ptr + kbyte // 2 + cols, v.to(tl.bfloat16), mask=mask)
    else:
        tl.store(c32_ptr + kbyte // 4 + cols, v, mask=mask)


@triton.jit
def _key_values(row, d, BLOCK_D: tl.constexpr):
    """(columns, their mask, the row's d values in fp32) of one indexer key."""
    offs = tl.arange(0, BLOCK_D)
    mask = offs < d
    return offs, mask, tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _index_k_write_kernel(k_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, d, stride_k, page_size, page_bytes, key_bytes,
                          LAYOUT: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    kbyte, sidx = _key_at(slot.to(tl.int64), page_size, page_bytes, key_bytes)
    offs, mask, x = _key_values(k_ptr + t * stride_k, d, BLOCK_D)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FP8_MAX_C
    _store_key(c8_ptr, c32_ptr, c16_ptr, kbyte, x, offs, mask, scale, LAYOUT)
    if LAYOUT == 0:
        tl.store(c32_ptr + sidx, scale)


@triton.jit
def _layer_norm_at(row, w_ptr, b_ptr, offs, mask, mean, rstd):
    """LayerNorm of a row's values at `offs` (fp32 stats given), rounded to the row's dtype as torch's output."""
    x = tl.load(row + offs, mask=mask, other=0.0)
    y = (x.to(tl.float32) - mean) * rstd * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return (y + tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype).to(tl.float32)


@triton.jit
def _index_k_norm_write_kernel(k_ptr, w_ptr, b_ptr, cos_ptr, sin_ptr, slot_ptr, c8_ptr, c32_ptr, c16_ptr, d, half,
                               eps, stride_k, stride_cos, stride_sin, page_size, page_bytes, key_bytes, q_ptr,
                               n_heads, stride_qt, stride_qh, INTERLEAVED: tl.constexpr, LAYOUT: tl.constexpr,
                               BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, Q_ROPE: tl.constexpr,
                               BLOCK_QH: tl.constexpr, Q_PROGRAMS: tl.constexpr = False,
                               PDL: tl.constexpr = False):
    """One token: LayerNorm of its raw key (fp32 stats), RoPE of the first 2*half values (`_rope_kernel`'s
    roundings: each product to the activation dtype), then `_index_k_write_kernel`'s encode at its slot; with
    Q_ROPE the RoPE of its query heads' first 2*half values too, in place (`_q_rope_role`)."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    if Q_ROPE:
        _q_rope_role(q_ptr, t, n_heads, half, stride_qt, stride_qh, cos_ptr + t * stride_cos,
                     sin_ptr + t * stride_sin, INTERLEAVED, BLOCK_P, BLOCK_QH, Q_PROGRAMS)
    if tl.program_id(1) > 0:  # a program of q's head blocks only (Q_PROGRAMS)
        return
    row = k_ptr + t * stride_k
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    kbyte, sidx = _key_at(slot.to(tl.int64), page_size, page_bytes, key_bytes)
    offs, mask, x = _key_values(row, d, BLOCK_D)
    mean = tl.sum(x, axis=0) / d
    diff = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(diff * diff, axis=0) / d + eps)
    p = tl.arange(0, BLOCK_P)
    pmask = p < half
    if INTERLEAVED:  # pairs (2p, 2p+1) -> [evens' | odds']
        i1, i2 = 2 * p, 2 * p + 1
    else:
        i1, i2 = p, p + half
    y1 = _layer_norm_at(row, w_ptr, b_ptr, i1, pmask, mean, rstd)
    y2 = _layer_norm_at(row, w_ptr, b_ptr, i2, pmask, mean, rstd)
    c = tl.load(cos_ptr + t * stride_cos + p, mask=pmask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin + p, mask=pmask, other=0.0).to(tl.float32)
    ty = k_ptr.dtype.element_ty
    r1 = (_rnd(y1 * c, ty) - _rnd(y2 * s, ty)).to(ty).to(tl.float32)
    r2 = (_rnd(y2 * c, ty) + _rnd(y1 * s, ty)).to(ty).to(tl.float32)
    rest = mask & (offs >= 2 * half)
    yr = tl.where(rest, _layer_norm_at(row, w_ptr, b_ptr, offs, rest, mean, rstd), 0.0)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(r1), axis=0), tl.max(tl.abs(r2), axis=0)), tl.max(tl.abs(yr), axis=0))
    scale = tl.maximum(amax, 1e-12) / FP8_MAX_C
    _store_key(c8_ptr, c32_ptr, c16_ptr, kbyte, r1, p, pmask, scale, LAYOUT)
    _store_key(c8_ptr, c32_ptr, c16_ptr, kbyte, r2, half + p, pmask, scale, LAYOUT)
    _store_key(c8_ptr, c32_ptr, c16_ptr, kbyte, yr, offs, rest, scale, LAYOUT)
    if LAYOUT == 0:
        tl.store(c32_ptr + sidx, scale)


def _index_layout(index_cache: torch.Tensor, layout: KVLayout | str, d: int, who: str) -> tuple[int, tuple]:
    """(the kernels' LAYOUT code of an indexer-key layout, (page_size, page bytes, key bytes) of the cache's
    pages); pages that do not hold whole keys of head dim d are an error naming `who`."""
    layout = get_kv_layout(layout, f"{who}: layout")
    if d % 4:
        raise ValueError(f"{who}: the head dim {d} is not a multiple of 4")
    ps = index_pages.page_size_of(index_cache, layout, d, who)
    return _INDEX_LAYOUT[layout], (ps, index_cache.stride(0), index_pages.key_bytes(layout, d))


def indexer_k_norm_write(index_cache: torch.Tensor, layout: KVLayout | str, slots: torch.Tensor, k_raw: torch.Tensor,
                         norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor, rope_dim: int, interleaved: bool, q: torch.Tensor | None = None) -> None:
    """GPU `reference.indexer_k_norm_write`: the key's LayerNorm, RoPE and write in one launch (were a torch
    LayerNorm, a RoPE kernel and the write: three launches a full layer, the first outside the PDL chain); with
    q [T, heads, D] the queries' RoPE in place in the same launch (one more launch a full layer before)."""
    t, d = k_raw.shape
    code, place = _index_layout(index_cache, layout, d, "indexer_k_norm_write")
    q_args = _q_rope_args(q, t, rope_dim, k_raw, "indexer_k_norm_write")
    if t == 0:
        return
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("indexer_k_norm_write: cos and sin need a unit last stride")
    k_raw = k_raw if k_raw.stride(-1) == 1 else k_raw.contiguous()
    c8, c32, c16 = _views(index_cache)
    half = rope_dim // 2
    _index_k_norm_write_kernel[(t, 1 + q_args[5])](
        k_raw, norm_weight, norm_bias, cos, sin, slots, c8, c32, c16, d, half, eps, k_raw.stride(0), cos.stride(0),
        sin.stride(0), *place, *q_args[:4], INTERLEAVED=interleaved, LAYOUT=code, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_P=triton.next_power_of_2(max(half, 1)), Q_ROPE=q is not None, BLOCK_QH=q_args[4],
        Q_PROGRAMS=q_args[5] > 0, num_warps=1, **pdl_args(k_raw.device))


def indexer_k_write(index_cache: torch.Tensor, layout: KVLayout | str, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Write indexer keys k [T, D] (LayerNorm + RoPE already applied) at `slots` of the page-major cache."""
    t, d = k.shape
    code, place = _index_layout(index_cache, layout, d, "indexer_k_write")
    if t == 0:
        return
    c8, c32, c16 = _views(index_cache)
    k = k if k.stride(-1) == 1 else k.contiguous()
    _index_k_write_kernel[(t,)](k, slots, c8, c32, c16, d, k.stride(0), *place, LAYOUT=code,
                                BLOCK_D=triton.next_power_of_2(d), num_warps=1, **pdl_args(k.device))
