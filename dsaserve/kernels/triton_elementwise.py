"""GPU row-wise ops of the decode step, one launch each: RMSNorm (with the residual add fused), SiLU*up,
in-place RoPE (request path stage 6; DESIGN.md "Kernels": fuse what a decode step launches), the overlap
scheduler's placeholder ids resolved (five torch kernels a step before; with the step's embedding and RoPE rows
in one launch: `embed_rope_rows`) and a decode graph's inputs read out of their pinned staging buffer by a kernel
(`copy_from_host`, and `stage_from_host` with the page table's changes).

Owns: the GPU variants of `reference.rms_norm`, `reference.add_rms_norm`, `reference.silu_and_mul`,
`reference.rope_inplace`, `reference.resolve_placeholders`, `reference.embed_rope_rows`, `reference.copy_from_host`
and `reference.stage_from_host`. Each takes its
reference's rounding steps (fp32 math, a rounding to the activation dtype wherever the torch ops round), so the two
differ only in the order of a sum and in the last bit of an rsqrt. Decode-size RMSNorm and SiLU*up outputs also
carry their FP8 copy for the next GEMM (`triton_fp8_gemm.attach_fp8`; from 33 rows, with cuBLAS's scale layout too,
up to `triton_fp8_gemm.CUBLAS_COPY_MAX_ROWS`). At decode a step launches ~20 norms and ~10 RoPEs: as torch ops each
was 5-8 kernels (H200 profile, bench/RESULTS.md), which cost time and leave ~1 µs gaps between them.
Imported only by `kernels/registry.py` after it checked that Triton and a CUDA device are there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsaserve.kernels import reference
from dsaserve.kernels.triton_fp8_gemm import attach_fp8, copy_buffers, quant_rows_fp8
from dsaserve.kernels.triton_utils import grid_dependency_sync, pdl_args


@triton.jit
def _store_fp8_groups(y, q_ptr, qs_ptr, row, N, col0, BLOCK: tl.constexpr, M_MAJOR: tl.constexpr):
    """Columns col0.. of a row, y [BLOCK] (already rounded to the activation dtype) -> e4m3 + one fp32 scale per 128
    values: `quant_act_fp8`'s rule and layout (values [M, N], scales [M, N/128], contiguous); with M_MAJOR the same
    scales again right after those, outer-dim-major ([N/128, M]: cuBLAS's; M the launch's rows, its grid's first
    dimension; `triton_fp8_gemm.copy_buffers`)."""
    g = tl.reshape(y.to(tl.float32), [BLOCK // 128, 128])
    q, scale = quant_rows_fp8(g)
    q = tl.reshape(q, [BLOCK])
    offs = col0 + tl.arange(0, BLOCK)
    tl.store(q_ptr + row * N + offs, q, mask=offs < N)
    kg = N // 128
    groups = col0 // 128 + tl.arange(0, BLOCK // 128)
    tl.store(qs_ptr + row * kg + groups, scale, mask=groups < kg)
    if M_MAJOR:
        m = tl.num_programs(0)
        tl.store(qs_ptr + m * kg + groups * m + row, scale, mask=groups < kg)


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, q_ptr, qs_ptr, N, eps, stride_x, stride_r, stride_y,
                     stride_s, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                     M_MAJOR: tl.constexpr = False, WEIGHT_FIRST: tl.constexpr = True, PDL: tl.constexpr = False):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    if WEIGHT_FIRST:  # no kernel writes the weight: its HBM read overlaps the wait for x's producer
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # s = x + residual, rounded to the activation dtype as torch's add would
        x = (x.to(tl.float32) + tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * inv).to(y_ptr.dtype.element_ty).to(tl.float32)  # HF: cast back, then scale
    if not WEIGHT_FIRST:
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (w * y).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + offs, y, mask=mask)
    if QUANT:
        _store_fp8_groups(y, q_ptr, qs_ptr, row, N, 0, BLOCK, M_MAJOR)


# RMSNorm's weight read before the PDL wait (a batch-1 step's 19 norms are each one program in the step's chain,
# and the weight, evicted by the step's GB of weights, came from HBM after the row's reduction); False: after it.
# The MLA KV write's kv_a norm follows it (`triton_kv_write`)
NORM_WEIGHT_FIRST = True


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    rows, n = x2.shape
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    s = torch.empty_like(x2) if residual is not None else y
    fp8 = copy_buffers(rows, n, y.dtype, x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x2, r2, weight, y, s, *_copy_args(fp8, y), n, eps, x2.stride(0), r2.stride(0),
                                  y.stride(0), s.stride(0), HAS_RESIDUAL=residual is not None,
                                  BLOCK=triton.next_power_of_2(n), num_warps=8 if n >= 4096 else 4,
                                  WEIGHT_FIRST=NORM_WEIGHT_FIRST, **_copy_flags(fp8), **pdl_args(x.device))
    return _with_copy(y.view(*x.shape[:-1], n), fp8), s.view(*x.shape[:-1], n)


def _copy_args(fp8: tuple | None, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's FP8 copy pointers (values, row-major scales), or y twice where it writes none (unread)."""
    return fp8[:2] if fp8 is not None else (y, y)


def _copy_flags(fp8: tuple | None) -> dict[str, bool]:
    """QUANT (a copy written) and M_MAJOR (its scales outer-dim-major too, `copy_buffers`)."""
    return {"QUANT": fp8 is not None, "M_MAJOR": fp8 is not None and fp8[2] is not None}


def _with_copy(out: torch.Tensor, fp8: tuple | None) -> torch.Tensor:
    """out with the FP8 copy its kernel wrote attached (a 2-D output: what a GEMM reads)."""
    if fp8 is not None and out.dim() == 2:
        attach_fp8(out, *fp8)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GPU `reference.rms_norm`."""
    return _norm(x, None, weight, eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """GPU `reference.add_rms_norm`: (rms_norm(x + residual), x + residual) in one pass."""
    return _norm(x, residual, weight, eps)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, q_ptr, qs_ptr, N, stride_x, stride_y, QUANT: tl.constexpr, BLOCK: tl.constexpr,
                     M_MAJOR: tl.constexpr = False, PDL: tl.constexpr = False):
    grid_dependency_sync(PDL)
    row = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK
    offs = col0 + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + N + offs, mask=mask, other=0.0)
    act = (g * tl.sigmoid(g)).to(y_ptr.dtype.element_ty).to(tl.float32)  # torch: silu rounds, then the mul
    y = (act * u.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + offs, y, mask=mask)
    if QUANT:  # this block's 128-groups (BLOCK is a multiple of 128 here)
        _store_fp8_groups(y, q_ptr, qs_ptr, row, N, col0, BLOCK, M_MAJOR)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GPU `reference.silu_and_mul`: x [.., 2I] = [gate | up] -> silu(gate) * up [.., I]."""
    x2 = _rows(x)
    rows, n = x2.shape[0], x2.shape[-1] // 2
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    # the FP8 copy needs whole 128-groups per program: the widest block that divides n (1536 -> 512)
    block = next((b for b in (2048, 1024, 512, 256, 128) if n % b == 0), min(triton.next_power_of_2(n), 2048))
    fp8 = copy_buffers(rows, n, y.dtype, x.device) if n % block == 0 else None
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x2, y, *_copy_args(fp8, y), n, x2.stride(0), y.stride(0),
                                                       BLOCK=block, **_copy_flags(fp8), **pdl_args(x.device))
    return _with_copy(y.view(*x.shape[:-1], n), fp8)


@triton.jit
def _rnd(v, ty: tl.constexpr):
    return v.to(ty).to(tl.float32)


@triton.jit
def _rope_heads(x_ptr, t, offs_h, H, half, stride_t, stride_h, cos_row, sin_row, INTERLEAVED: tl.constexpr,
                BLOCK_P: tl.constexpr):
    """Heads `offs_h` of token t of x rotated in place by the pair angles at cos_row / sin_row; `half` = rope dims
    / 2 rotated pairs, BLOCK_P its power of two. Also the q RoPE the KV-write kernels fuse (`triton_kv_write`)."""
    offs_p = tl.arange(0, BLOCK_P)
    pmask = offs_p < half
    mask = (offs_h[:, None] < H) & pmask[None, :]
    base = x_ptr + t * stride_t + offs_h[:, None] * stride_h
    if INTERLEAVED:  # pairs (2p, 2p+1) -> [evens' | odds'] (HF's GLM / DeepSeek main RoPE)
        i1, i2 = 2 * offs_p, 2 * offs_p + 1
    else:
        i1, i2 = offs_p, offs_p + half
    x1 = tl.load(base + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_row + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_row + offs_p, mask=pmask, other=0.0).to(tl.float32)[None, :]
    tl.debug_barrier()  # every load of these heads is done before any store overwrites them (in place)
    ty = x_ptr.dtype.element_ty  # each product rounded to the activation dtype, as the torch ops round
    tl.store(base + offs_p[None, :], (_rnd(x1 * c, ty) - _rnd(x2 * s, ty)).to(ty), mask=mask)
    tl.store(base + half + offs_p[None, :], (_rnd(x2 * c, ty) + _rnd(x1 * s, ty)).to(ty), mask=mask)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, H, half, stride_t, stride_h, stride_c, INTERLEAVED: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr = False):
    """Program (token, block of heads): `_rope_heads`."""
    grid_dependency_sync(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    _rope_heads(x_ptr, t, offs_h, H, half, stride_t, stride_h, cos_ptr + t * stride_c, sin_ptr + t * stride_c,
                INTERLEAVED, BLOCK_P)


def rope_heads_block(heads: int) -> int:
    """Heads a block of `_rope_heads` takes (a program of `rope_inplace`, a loop step of the fused writes)."""
    return min(triton.next_power_of_2(heads), 16)


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """GPU `reference.rope_inplace`: x [T, R] or [T, H, R] (any strides, last one 1) rotated in place."""
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rope_inplace: x, cos and sin need a unit last stride (and cos/sin alike)")
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    t, h, r = x3.shape
    block_h = rope_heads_block(h)
    if t:
        _rope_kernel[(t, triton.cdiv(h, block_h))](x3, cos, sin, h, r // 2, x3.stride(0), x3.stride(1), cos.stride(0),
                                                  INTERLEAVED=interleaved, BLOCK_P=triton.next_power_of_2(r // 2),
                                                  BLOCK_H=block_h, **pdl_args(x.device))
    return x


RESOLVE_BLOCK = 128  # ids a program: a decode batch in one


@triton.jit
def _resolve_kernel(ids_ptr, future_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    grid_dependency_sync(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=0)
    late = (ids < 0) & (offs < n)
    resolved = tl.load(future_ptr + tl.where(late, -1 - ids, 0), mask=late, other=0)
    tl.store(ids_ptr + offs, resolved, mask=late)


def resolve_placeholders(input_ids: torch.Tensor, future_token_ids: torch.Tensor) -> None:
    """GPU `reference.resolve_placeholders`: one launch (both 1-D and contiguous, one dtype). A placeholder -1-j
    must have j < len(future_token_ids), as the engine's sample rows and drafts do (no bounds check on the device)."""
    if any(t.dim() != 1 or t.stride(0) != 1 for t in (input_ids, future_token_ids)) or \
            input_ids.dtype != future_token_ids.dtype:
        raise ValueError("resolve_placeholders: input_ids and future_token_ids must be 1-D, contiguous, one dtype")
    n = input_ids.numel()
    if n:  # one block size for every batch: three specialisations in all (n = 1, n % 16 == 0, other)
        _resolve_kernel[(triton.cdiv(n, RESOLVE_BLOCK),)](input_ids, future_token_ids, n, BLOCK=RESOLVE_BLOCK,
                                                          **pdl_args(input_ids.device))


EMBED_BLOCK = 1024  # a row's elements a program: 6 programs a token at GLM's hidden 6144


@triton.jit
def _embed_rope_kernel(ids_ptr, future_ptr, weight_ptr, pos_ptr, table_ptr, h_ptr, rows_ptr, H, R, w_stride,
                       t_stride, RESOLVE: tl.constexpr, BLOCK: tl.constexpr, BLOCK_R: tl.constexpr,
                       PDL: tl.constexpr):
    grid_dependency_sync(PDL)  # the ids and the future tokens: written by the launches before
    t, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    row = tl.load(ids_ptr + t).to(tl.int64)
    if RESOLVE and row < 0:  # every program of the token resolves it; its first writes it back
        row = tl.load(future_ptr - 1 - row).to(tl.int64)
        if part == 0:
            tl.store(ids_ptr + t, row.to(ids_ptr.dtype.element_ty))
    offs = part * BLOCK + tl.arange(0, BLOCK)
    tl.store(h_ptr + t * H + offs, tl.load(weight_ptr + row * w_stride + offs, mask=offs < H), mask=offs < H)
    if part == 0:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        tl.store(rows_ptr + t * R + r, tl.load(table_ptr + pos * t_stride + r, mask=r < R), mask=r < R)


def embed_rope_rows(ids: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
                    future_token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPU `reference.embed_rope_rows`: one PDL launch for what a decode graph ran as three after its inputs
    landed (the placeholders' resolve, then two aten `index_select`s outside the PDL chain, ~2.2 µs each in a
    batch-1 step: bench/RESULTS.md fifty-seventh session). Unlike the gathers (aten's device assert), an id or
    position out of its table's rows is not checked on the device: the scheduler's request limits check prompt ids
    against the vocabulary, and positions stay below max_position_embeddings."""
    if ids.dim() != 1 or positions.shape != ids.shape or weight.stride(-1) != 1 or table.stride(-1) != 1 or \
            not ids.is_contiguous() or (future_token_ids is not None and future_token_ids.dtype != ids.dtype):
        raise ValueError("embed_rope_rows: ids (contiguous) and positions 1-D of one length, weight and table with "
                         "a unit last stride, future_token_ids of the ids' dtype")
    t, h, r = ids.numel(), weight.shape[1], table.shape[1]
    out = torch.empty(t, h, dtype=weight.dtype, device=weight.device)
    rows = torch.empty(t, r, dtype=table.dtype, device=table.device)
    if t:
        resolve = future_token_ids is not None
        _embed_rope_kernel[(t, triton.cdiv(h, EMBED_BLOCK))](
            ids, future_token_ids if resolve else ids, weight, positions, table, out, rows, h, r, weight.stride(0),
            table.stride(0), RESOLVE=resolve, BLOCK=EMBED_BLOCK, BLOCK_R=triton.next_power_of_2(r),
            **pdl_args(ids.device))
    return out, rows


# A kernel reads at most this many bytes of pinned memory itself; more take the copy engine. Why a kernel: in a
# decode graph the first kernel after the inputs' copy node started ~14 µs after the copy ended (H100 timelines,
# b1 and b128); read by a kernel the graph's chain ran 2.8-4.4 µs sooner a replay and the b128 1K step 5 µs sooner
# overlapped, every round (bench/RESULTS.md, forty-sixth session; the rest of the gap was not timed apart).
# Past tens of KB the copy engine's rate (~47 GB/s there, `bench/probe_table_copy.py`) wins.
HOST_READ_MAX_BYTES = 64 << 10
HOST_READ_BLOCK = 1024


@triton.jit(do_not_specialize=["n"])
def _from_host_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


class _HostPointer:
    """A pinned host tensor as a kernel's pointer argument: under unified addressing (every 64-bit CUDA platform)
    pinned memory is mapped into the device's address space at the same address."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """GPU `reference.copy_from_host`: up to HOST_READ_MAX_BYTES, one launch whose loads read the pinned buffer
    (capturable: a replay reads the buffer as it is then); larger copies, and sources that are not pinned, take
    the copy engine."""
    if src.shape != dst.shape or src.dtype != dst.dtype or not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_from_host: src and dst must be contiguous, of one shape and dtype")
    n = src.numel()
    if n == 0 or n * src.element_size() > HOST_READ_MAX_BYTES or src.is_cuda or not src.is_pinned():
        dst.copy_(src, non_blocking=True)
        return
    _from_host_kernel[(triton.cdiv(n, HOST_READ_BLOCK),)](_HostPointer(src), dst, n, BLOCK=HOST_READ_BLOCK)


@triton.jit(do_not_specialize=["n", "max_deltas", "table_n"])
def _stage_from_host_kernel(src_ptr, rows_ptr, changes_ptr, table_ptr, n, max_deltas, table_n, BLOCK: tl.constexpr):
    """Programs up to cdiv(n, BLOCK) copy the rows; the rest read the count and each take BLOCK of the changes (a
    program past the count returns after one load: the host link carries only what changed)."""
    pid = tl.program_id(0)
    row_programs = tl.cdiv(n, BLOCK)
    if pid < row_programs:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        tl.store(rows_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)
    else:
        count = tl.load(changes_ptr)
        offs = (pid - row_programs) * BLOCK + tl.arange(0, BLOCK)
        live = offs < tl.minimum(count, max_deltas)
        idx = tl.load(changes_ptr + 1 + offs, mask=live, other=0)
        live = live & (idx >= 0) & (idx < table_n)  # a bad index is dropped, never a wild store
        tl.store(table_ptr + idx, tl.load(changes_ptr + 1 + max_deltas + offs, mask=live), mask=live)


def stage_from_host(rows: torch.Tensor, rows_src: torch.Tensor, table: torch.Tensor, changes: torch.Tensor,
                    max_deltas: int) -> None:
    """GPU `reference.stage_from_host`: one launch whose loads read the pinned buffers (capturable: a replay reads
    the rows, the count and that many changes as they are then). Not pinned: the reference."""
    n = rows.numel()
    if rows_src.numel() != n or changes.numel() != 1 + 2 * max_deltas or not all(
            t.is_contiguous() for t in (rows, rows_src, table, changes)):
        raise ValueError(f"stage_from_host: {rows_src.numel()} rows for {n}, {changes.numel()} change values for 1 + "
                         f"2 x {max_deltas} (all contiguous)")
    if not rows.is_cuda or any(t.is_cuda or not t.is_pinned() for t in (rows_src, changes)):
        return reference.stage_from_host(rows, rows_src, table, changes, max_deltas)
    grid = (triton.cdiv(n, HOST_READ_BLOCK) + triton.cdiv(max_deltas, HOST_READ_BLOCK),)
    _stage_from_host_kernel[grid](_HostPointer(rows_src), rows, _HostPointer(changes), table, n, max_deltas,
                                  table.numel(), BLOCK=HOST_READ_BLOCK)
