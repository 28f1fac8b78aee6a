"""Linear layers over checkpoint weights: FP8 block-scaled (GPU path) or dequantised dense (CPU path).

Owns: how one projection holds its weight between loading and running. Loading stores exactly what is on
disk (FP8 + `weight_scale_inv`, or BF16); `finalize()` (vLLM's process_weights_after_loading) then either
keeps FP8 for the FP8 GEMM kernel or dequantises once into the compute dtype for the reference path.
Each forward adds the bytes it read to the `weight_bytes_read` counter (the ledger's weight-read term).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.engine.counters import COUNTERS
from dsaserve.kernels import registry
from dsaserve.kernels.reference import dequant_fp8_weight
from dsaserve.weights.spec import scale_shape


class Linear(nn.Module):
    """y = x W^T with W [out, in]; `quantized` says whether the checkpoint stores it as FP8."""

    def __init__(self, in_features: int, out_features: int, quantized: bool):
        super().__init__()
        self.in_features, self.out_features, self.quantized = in_features, out_features, quantized
        dtype = torch.float8_e4m3fn if quantized else torch.bfloat16
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        if quantized:
            self.weight_scale_inv = nn.Parameter(torch.empty(scale_shape((out_features, in_features)),
                                                             dtype=torch.float32), requires_grad=False)
        else:
            self.weight_scale_inv = None
        self.disk_bytes = out_features * in_features * (1 if quantized else 2) + (
            self.weight_scale_inv.numel() * 4 if quantized else 0)
        self.keep_fp8 = False

    def finalize(self, dtype: torch.dtype, keep_fp8: bool) -> None:
        """After loading: keep FP8 (GPU kernels) or dequantise once into `dtype` (reference path)."""
        self.keep_fp8 = keep_fp8 and self.quantized
        if self.keep_fp8:
            return
        if self.quantized:
            dense = dequant_fp8_weight(self.weight.data, self.weight_scale_inv.data, dtype)
            self.weight = nn.Parameter(dense, requires_grad=False)
            self.weight_scale_inv = None
        else:
            self.weight = nn.Parameter(self.weight.data.to(dtype), requires_grad=False)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense matrix (weight absorption needs kv_b_proj this way on both paths)."""
        if self.weight.dtype == torch.float8_e4m3fn:
            return dequant_fp8_weight(self.weight, self.weight_scale_inv, dtype)
        return self.weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        COUNTERS.add("weight_bytes_read", self.disk_bytes)
        if self.keep_fp8:
            return registry.get_ops(x.device).fp8_linear(x, self.weight, self.weight_scale_inv)
        return nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.quantized}"
