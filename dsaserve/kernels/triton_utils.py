"""Shared Triton helpers for the GPU kernels (`kernels/triton_*.py`); imported only when Triton is present.

Owns: `opaque_index`, which hides a gathered row index from Triton's alignment analysis. KV rows are
not all 16-byte multiples (indexer rows are 132 B, tiny-config fp8_ds_mla rows 164 B), and Triton 3.6
was seen (PTX of the indexer kernel, offline sm_90 compile) to vectorise a masked row gather of a
132-byte-stride cache as 16-byte loads -> `misaligned address` on the H200. An index that went through
an inline-asm move carries no divisibility facts, so the row base is only assumed as aligned as the
(runtime-specialised) row stride makes it: 16-byte loads stay for 656-byte rows, byte loads for 132.

Also owns programmatic dependent launch (PDL, Hopper+): every kernel takes a `PDL` constexpr and starts with
`grid_dependency_sync(PDL)`; its launcher passes `**pdl_args(device)`. Launched with the PDL attribute,
a kernel may be scheduled while the kernel before it still runs; its programs then wait (griddepcontrol.wait)
until that kernel has finished and its writes are visible, and only then let the next kernel launch. So a
decode step's ~150 back-to-back launches overlap their launch latency and block scheduling with the
previous kernel's tail instead of paying it in the gap (CUDA graphs capture the programmatic edges).
The wait comes first, before any load or store, so no kernel can read an input its producer has not
finished or overwrite one its consumer still reads (the exceptions are weights, which are no kernel's output: the
split-K GEMM's producer asks for its first weight tiles before it, `gluon_fp8_splitk`; RMSNorm reads its weight
before it, `triton_elementwise.NORM_WEIGHT_FIRST`; with `triton_moe_route.WEIGHTS_FIRST` on, the router GEMV its
rows and moe_route its bias). DSASERVE_PDL=0 turns it off (A/B runs).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from dsaserve.common import envs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRET:  # the interpreter has no inline asm; it needs no such fence

    @triton.jit
    def opaque_index(x):
        return x

    @triton.jit
    def prefetch_l2(ptrs):
        pass

else:

    @triton.jit
    def opaque_index(x):
        return tl.inline_asm_elementwise("mov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64, is_pure=True, pack=1)

    @triton.jit
    def prefetch_l2(ptrs):  # not pure: kept although its (dummy) result is unused
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs.to(tl.int64)],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_rows(c_ptr, row, stride_c, ELEM: tl.constexpr, ROW_BYTES: tl.constexpr, LINES: tl.constexpr):
    """Ask L2 for every 128-byte line of the gathered rows (their first and last byte included): no registers held
    (the sparse MLA kernels: the next key tile's rows travel HBM -> L2 while this one computes)."""
    offs = tl.minimum(tl.arange(0, LINES) * 128, ROW_BYTES - 1)
    base = c_ptr.to(tl.pointer_type(tl.uint8)) + row * (stride_c * ELEM)
    prefetch_l2(base[:, None] + offs[None, :])


def made_once(cache: dict, key, device: torch.device, who: str, make):
    """cache[key], made by `make()` on first use and kept: the persistent buffers kernels leave as they found them
    (a split GEMM's arrival counters, the cooperative selection's workspace, the argmax's counters), which every
    CUDA graph then shares. Never first made inside a capture: there its memory would come from that graph's pool
    and its zeros from a memset node that runs only on that graph's replay (a warm start that captured a small
    bucket first got non-finite logits so); callers make theirs when the registry binds the GPU ops."""
    if key not in cache:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{who}: first made inside a CUDA-graph capture (make it before it)")
        cache[key] = make()
    return cache[key]


def on_side_stream(device: torch.device) -> int:
    """1 on a high-priority stream (the step's one side stream; split GEMMs there today: the unfused shared
    expert's), else 0: which set of a split GEMM's counters a launch takes, so two split GEMMs running at once never
    share a tile's counter."""
    return int(device.type == "cuda" and torch.cuda.current_stream(device).priority < 0)


class TensorNote:
    """Tensors hung on a freshly produced tensor for its next reader, under one attribute name (the producer's
    promise: `triton_fp8_gemm`'s FP8 copy of an activation, `triton_sparse_mla`'s split partials of a latent)."""

    def __init__(self, attr: str):
        self.attr = attr

    def attach(self, t: torch.Tensor, value: tuple) -> torch.Tensor:
        setattr(t, self.attr, value)
        return t

    def get(self, t: torch.Tensor) -> tuple | None:
        return getattr(t, self.attr, None)

    def drop(self, t: torch.Tensor) -> None:
        delattr(t, self.attr)


@triton.jit
def grid_dependency_sync(PDL: tl.constexpr):
    """Under PDL: wait for the previous kernel (all of it, writes visible), then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=16)
def _pdl_supported(device_index: int, enabled: bool) -> bool:
    return enabled and not INTERPRET and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """Launch keywords for a kernel with a `PDL` constexpr: on for Hopper and newer, off elsewhere."""
    if device.type != "cuda":
        return {"PDL": False}
    on = _pdl_supported(device.index if device.index is not None else torch.cuda.current_device(),
                        envs.DSASERVE_PDL)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
