"""What the Gluon sparse MLA kernels share (issue 17; request path stage 6, attention): whether Gluon runs here,
the heads a program takes, and the prologue helpers of `gluon_sparse_mla` (single partition) and
`gluon_sparse_mla_ws` (warp-specialised): Q into shared memory, a token's valid end and a split's key range.

Owns: `HAVE_GLUON`, `available`, `BLOCK_H`, `_valid_end`, `_load_q`, `_key_range`.
Gluon is Triton's lower-level language (triton.experimental.gluon, Triton >= 3.5): no interpreter runs it, so CPU
runs never reach these kernels (`available` says no).
"""

from __future__ import annotations

import torch
import triton.language as tl

try:  # Gluon ships with Triton >= 3.5; older Tritons (and CPU runs) take the Triton kernels
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

BLOCK_H = tl.constexpr(64)  # heads a program: wgmma's M is 64 a warpgroup


def available(device: torch.device) -> bool:
    """Whether these kernels can run here: Gluon importable, a CUDA device of compute capability 9.x (wgmma)."""
    return (HAVE_GLUON and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] == 9)


if HAVE_GLUON:

    @gluon.jit
    def _valid_end(slot_ptr, row_base, n_keys, num_warps: gl.constexpr):
        """One past the token's last valid (>= 0) slot (`triton_sparse_mla._valid_end`: slots come first)."""
        scan_l: gl.constexpr = gl.BlockedLayout([4], [32], [num_warps], [0])
        SCAN: gl.constexpr = 4 * 32 * num_warps
        last = n_keys * 0 - 1
        for s0 in range(0, n_keys, SCAN):
            o = s0 + gl.arange(0, SCAN, layout=scan_l)
            sl = gl.load(slot_ptr + row_base + o, mask=o < n_keys, other=-1)
            last = gl.maximum(last, gl.max(gl.where(sl >= 0, o, -1), axis=0))
        return last + 1

    @gluon.jit
    def _load_q(q_smem, ptr, t, hb, n_heads, stride_t, stride_h, D: gl.constexpr, num_warps: gl.constexpr):
        """Q rows of this program's heads (zeros past n_heads) as bf16 into shared memory."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, ld)).to(gl.int64)
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        q = gl.load(ptr + t * stride_t + h[:, None] * stride_h + cols[None, :], mask=(h < n_heads)[:, None],
                    other=0.0)
        q_smem.store(q.to(gl.bfloat16))

    @gluon.jit
    def _key_range(slot_ptr, slot_base, sp, n_keys, SPLIT: gl.constexpr, BLOCK_K: gl.constexpr,
                   num_warps: gl.constexpr):
        """(k0, k1, tiles) of this program: its split's share of the token's valid slots in whole tiles
        (`triton_sparse_mla._split_range`), or all of them."""
        kend = _valid_end(slot_ptr, slot_base, n_keys, num_warps)
        if SPLIT:
            per = gl.cdiv(gl.cdiv(kend, gl.num_programs(2)), BLOCK_K) * BLOCK_K
            k0 = sp * per
            k1 = gl.minimum(k0 + per, kend)
        else:
            k0 = sp * 0
            k1 = kend + sp * 0
        return k0, k1, gl.maximum(gl.cdiv(k1 - k0, BLOCK_K), 0).to(gl.int32)
