"""Linear layers over checkpoint weights: FP8 block-scaled (GPU path) or dequantised dense (CPU path).

Owns: how one projection holds its weight between loading and running. Loading stores exactly what is on
disk (FP8 + `weight_scale_inv`, or BF16); `finalize()` (vLLM's process_weights_after_loading) then either
keeps FP8 for the FP8 GEMM kernel or dequantises once into the compute dtype for the reference path.
`disk_bytes` is what one forward reads (the ledger's weight-read term; `model/step_counts.py` adds it up).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.kernels import registry
from dsaserve.kernels.reference import dequant_fp8_weight
from dsaserve.weights.spec import scale_shape

FP8_BLOCK = 128  # weight_scale_inv block (rows and columns)


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

    def release_weight(self) -> None:
        """The weight now lives elsewhere (kv_b_proj, absorbed into W_uk / W_uv): free it, keep disk_bytes
        (the ledger's read term). Saves the FP8 copy on the GPU (12.6 MB per GLM-5.3 layer), the dense
        one on the CPU."""
        self.weight = nn.Parameter(self.weight.data.new_empty(0), requires_grad=False)
        self.weight_scale_inv = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_fp8:
            return registry.get_ops(x.device).fp8_linear(x, self.weight, self.weight_scale_inv)
        return registry.get_ops(x.device).small_linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8={self.quantized}"


class MergedLinear(Linear):
    """Several FP8 projections of the same input as one GEMM (one weight stream, one launch), e.g.
    q_a + kv_a + the indexer's wk, or an MLP's gate + up. Each part's rows are padded to a whole 128-row
    scale block (kv_a has 576 rows), so every part keeps its own block scales; `forward` returns each
    part's columns as a view. Built after loading, on the GPU path only: the reference path keeps its
    separate dense matmuls bit-for-bit."""

    def __init__(self, parts: list[Linear]):
        nn.Module.__init__(self)  # not Linear.__init__: its empty full-size weight would be thrown away
        k = parts[0].in_features
        rows = [-(-p.out_features // FP8_BLOCK) * FP8_BLOCK for p in parts]
        self.in_features, self.out_features, self.quantized = k, sum(rows), True
        w = torch.zeros(sum(rows), k, dtype=torch.float8_e4m3fn, device=parts[0].weight.device)
        self.slices: list[tuple[int, int]] = []
        start = 0
        for p, n in zip(parts, rows, strict=True):
            w[start:start + p.out_features] = p.weight.data
            self.slices.append((start, start + p.out_features))
            start += n
        self.weight = nn.Parameter(w, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.cat([p.weight_scale_inv.data for p in parts]), requires_grad=False)
        self.disk_bytes = sum(p.disk_bytes for p in parts)  # what the checkpoint holds; padding is not read
        self.keep_fp8 = True

    @staticmethod
    def mergeable(parts: list[Linear]) -> bool:
        return all(p.keep_fp8 and p.weight_scale_inv is not None and p.in_features == parts[0].in_features
                   for p in parts)

    def full_output(self, x: torch.Tensor) -> torch.Tensor:
        """All parts' columns side by side (gate | up, for a fused SiLU*up)."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        y = super().forward(x)
        return [y[..., a:b] for a, b in self.slices]
