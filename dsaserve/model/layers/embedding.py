"""Token embedding (stage 5) and the lm_head (stage 8). Vocab-parallel sharding plugs in here under TP."""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.engine.counters import COUNTERS


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden, dtype=torch.bfloat16), requires_grad=False)

    def finalize(self, dtype: torch.dtype) -> None:
        self.weight = nn.Parameter(self.weight.data.to(dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


class LMHead(Embedding):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        COUNTERS.add("weight_bytes_read", self.weight.numel() * 2)
        return (h @ self.weight.t()).float()
