"""StepContext: what every layer of one forward shares (batch metadata, KV pool, RoPE tables, kernels)."""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch

from dsaserve.engine.kv_pool import KVPool
from dsaserve.model.forward_batch import ForwardBatch


@dataclass
class StepContext:
    batch: ForwardBatch
    pool: KVPool
    cos: torch.Tensor  # [T, rope/2]
    sin: torch.Tensor
    ops: types.SimpleNamespace
    topk_slots: torch.Tensor | None = None  # [T, index_topk] from the last full indexer layer
    selected: int | None = None  # slots sparse MLA reads per layer this step (host-side count, cached)
    side_stream: torch.cuda.Stream | None = None  # full layers' indexer selection overlaps the q path here
