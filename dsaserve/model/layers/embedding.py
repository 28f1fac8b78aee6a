"""Token embedding (stage 5) and the lm_head (stage 8), vocab-parallel under TP.

Under TP each rank holds rows [r V/tp, (r+1) V/tp) of both tables (the checkpoint rows, sliced by the loader).
The embedding looks up the ids that fall in its rows, zeros the rest and all-reduces (note 001: "嵌入词表并行
查表 + AllReduce"); the lm_head computes its V/tp logits per row and all-gathers them along the vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.common import envs
from dsaserve.distributed.collectives import all_gather, all_reduce
from dsaserve.distributed.parallel_state import get_parallel_state
from dsaserve.distributed.sharding import mark_sharded, tp_shard
from dsaserve.kernels import cublaslt_tuning


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        state = get_parallel_state()
        shard, self.group = tp_shard(state, 0), state.tp_group
        rows = vocab if shard is None else shard.size(vocab)
        self.vocab_start = 0 if shard is None else shard.rank * rows
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=torch.bfloat16), requires_grad=False)
        mark_sharded(shard, self.weight)

    def finalize(self, dtype: torch.dtype) -> None:
        self.weight = nn.Parameter(self.weight.data.to(dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return nn.functional.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        return all_reduce(out, self.group)


# the old path: bf16 logits copied to float32 here, a 79 MB write at batch 128 (58 us on the H200); `profile_decode
# --ab float_logits` times it against the GEMM's own dtype
FLOAT_COPY = False


class LMHead(Embedding):
    def forward(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits in the GEMM's dtype (float32 under DSASERVE_FP32_LM_HEAD or a float32 model): bf16 logits go to
        the sampler as they are, whose argmax is exact on them and which turns them to float32 before anything
        that changes or normalises them (model/sampler.py). Under TP the vocab gather stays float32 (the ledger's
        `logits_bytes`). `out` [rows, V] of `out_dtype()`: written and returned (the CUDA graphs' one logits
        buffer, engine/cuda_graph_runner.py) by the GEMM on one GPU, else by the copy the path makes anyway
        (the gather's reorder, the float copy); only the opt-in float32 GEMM adds one."""
        if out is not None and out.dtype != self.out_dtype():
            raise ValueError(f"lm_head: the logits buffer is {out.dtype}, the logits {self.out_dtype()}")
        if envs.DSASERVE_FP32_LM_HEAD and h.dtype != torch.float32:
            logits = _logits_fp32(h, self.weight)
        elif out is not None and self.group.size == 1 and out.dtype == self.weight.dtype:
            tuned = cublaslt_tuning.lm_head(h, self.weight, out) if h.is_cuda else None
            return tuned if tuned is not None else torch.mm(h, self.weight.t(), out=out)
        else:  # bf16 logits: at a logit of ~10-20 one bf16 step is 0.06-0.12, so close tokens tie exactly
            logits = h @ self.weight.t()
            if out is None or self.group.size > 1:  # into `out` on one GPU, the copy converts
                logits = logits.to(self.out_dtype())  # a copy only under FLOAT_COPY or TP
        return all_gather(logits, self.group, dim=-1, out=out)

    def out_dtype(self) -> torch.dtype:
        """The dtype `forward` returns: the GEMM's, float32 under TP (the gather) or FLOAT_COPY."""
        if self.weight.dtype == torch.float32 or envs.DSASERVE_FP32_LM_HEAD or FLOAT_COPY or self.group.size > 1:
            return torch.float32
        return self.weight.dtype


def _logits_fp32(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """h @ weight.T accumulated and written in float32 from bf16 operands: cuBLAS's out_dtype GEMM on CUDA
    (no fp32 copy of the table); elsewhere through a float32 copy (the small models' quality runs)."""
    if h.is_cuda and hasattr(torch.ops.aten.mm, "dtype"):
        return torch.mm(h.reshape(-1, h.shape[-1]), weight.t(), out_dtype=torch.float32).view(*h.shape[:-1], -1)
    return h.float() @ weight.float().t()
