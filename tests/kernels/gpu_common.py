"""Shared set-up of the GPU kernel tests (`test_gpu_*.py`): each kernel (`kernels/triton_*.py`) against its
reference on the same random inputs.

Runs on a CUDA device (skipped cleanly without one). For development without a GPU, the Triton
interpreter runs them on the CPU: `TRITON_INTERPRET=1 DSASERVE_TEST_TRITON_INTERPRET=1 pytest ...`; the
interpreter truncates where the GPU rounds, so bounds are doubled there.
Every test draws a fresh seed (printed in the failure message). Outputs the op allocates are poisoned
by filling the caching allocator's free memory with NaN first, so an element the kernel never wrote
shows up as NaN. Relative errors are ||got - ref|| / ||ref||; the bounds, and where they come from:
  BF16: 1e-2   bf16 operands / outputs (8-bit mantissa, 2^-9 rounding) with fp32 accumulation
  FP8A: 6e-2   activations quantised per (token, 128) to e4m3 (3-bit mantissa: ~2.6% RMS on
               Gaussian data) where the reference keeps them exact (prefill GEMMs, prefill MoE)
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

_INTERP = os.environ.get("DSASERVE_TEST_TRITON_INTERPRET") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_gpu_kernels = pytest.mark.skipif(not HAS_TRITON or not (torch.cuda.is_available() or _INTERP),
                                          reason="GPU kernels need CUDA + Triton (or the Triton interpreter)")
SLACK = 2.0 if DEVICE == "cpu" else 1.0
BF16 = 1e-2 * SLACK
FP8A = 6e-2 * SLACK
# KV encode vs kv_pool's: same bytes but for rare rounding ties (the interpreter truncates: no bound there)
ENC_REL, ENC_BYTES = (1e-2, 0.01) if DEVICE == "cuda" else (0.1, 0.5)
BIG = DEVICE == "cuda"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def poison_free_memory() -> None:
    """Fill freed allocator blocks (large and small pools) with NaN so unwritten outputs are visible."""
    if DEVICE != "cuda":
        return
    big = torch.full((64 << 20,), float("nan"), device=DEVICE)
    small = [torch.full((1 << 16,), float("nan"), device=DEVICE) for _ in range(64)]
    del big, small


def randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def gpu_modules():
    from dsaserve.kernels import triton_fp8_gemm, triton_indexer, triton_kv_write, triton_moe, triton_sparse_mla

    return triton_fp8_gemm, triton_indexer, triton_kv_write, triton_moe, triton_sparse_mla


SMALL_ROWS = 32  # triton_fp8_gemm.SMALL_M: decode-size outputs carry an FP8 copy
BF16_ULP = dict(rtol=2 ** -6 * SLACK, atol=2 ** -6 * SLACK)  # one bf16 rounding apart (8-bit mantissa)


def _interpreter_dot_reads_bf16() -> None:
    """Triton 3.9's interpreter keeps bf16 as raw uint16 and its `create_dot` multiplies those integers
    (every bf16 tl.dot comes out ~1e10): widen bf16 operands to float32 (exact) before its matmul."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def widen(x):
        if x.dtype != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    interpreter.InterpreterBuilder.create_dot = lambda self, a, b, d, *rest: dot(self, widen(a), widen(b), d, *rest)


if _INTERP and HAS_TRITON:
    _interpreter_dot_reads_bf16()
