"""Norms: RMSNorm (HF semantics: normalise in fp32, cast, scale), with the residual add fused in for the
decoder's residual stream, and the indexer's k_norm LayerNorm. Kernels come from the registry (one launch
each on the GPU)."""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.kernels.registry import get_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16), requires_grad=False)

    def finalize(self, dtype: torch.dtype) -> None:
        self.weight = nn.Parameter(self.weight.data.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return get_ops(x.device).rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and the next norm in one pass."""
        return get_ops(x.device).add_rms_norm(x, residual, self.weight, self.eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with weight+bias loaded from the checkpoint (indexer k_norm, eps 1e-6 as in HF)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__(dim, eps=eps)
        self.weight.requires_grad_(False)
        self.bias.requires_grad_(False)

    def finalize(self, dtype: torch.dtype) -> None:
        self.weight = nn.Parameter(self.weight.data.to(dtype), requires_grad=False)
        self.bias = nn.Parameter(self.bias.data.to(dtype), requires_grad=False)
