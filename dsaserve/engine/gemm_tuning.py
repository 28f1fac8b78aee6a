"""Which of a model's GEMMs the start-up's cuBLASLt timing covers (`kernels/cublaslt_tuning.py`, issue 17).

Owns: `projection_shapes` (the FP8 projections cuBLAS's block-scaled GEMM takes) and `tune_model` (those, and the
lm_head where one GPU writes bf16 logits with torch.mm), so the kernels folder needs nothing of the model's.
"""

from __future__ import annotations

import torch

from dsaserve.common import envs
from dsaserve.kernels import cublaslt_tuning
from dsaserve.kernels.triton_fp8_gemm import SMALL_M, scaled_mm_shape_ok
from dsaserve.model.layers.linear import Linear


def projection_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """(N, K) of every FP8 projection the cuBLAS path takes (`scaled_mm_shape_ok`), once each."""
    shapes = {tuple(mod.weight.shape) for mod in model.modules()
              if isinstance(mod, Linear) and mod.weight.dtype == torch.float8_e4m3fn and mod.weight.dim() == 2}
    return sorted(s for s in shapes if scaled_mm_shape_ok(*s))


def tune_model(model: torch.nn.Module, device: torch.device, max_rows: int = cublaslt_tuning.ROW_CLASSES[-1]
               ) -> dict | None:
    """`cublaslt_tuning.tune` over the model's projections from SMALL_M + 1 rows and, where one GPU writes the bf16
    logits with torch.mm (no TP, no DSASERVE_FP32_LM_HEAD), its lm_head; None where the GPU kernels are off
    (DSASERVE_KERNELS=reference)."""
    if envs.DSASERVE_KERNELS == "reference":
        return None
    head = getattr(model, "lm_head", None)
    one_gpu_bf16 = head is not None and head.group.size == 1 and not envs.DSASERVE_FP32_LM_HEAD
    return cublaslt_tuning.tune(projection_shapes(model), max_rows, device, head.weight if one_gpu_bf16 else None,
                                min_rows=SMALL_M + 1)
