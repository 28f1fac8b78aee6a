"""DSA lightning indexer (full layers): score every visible key, keep the top-k as physical slots.

Owns: q_idx = wq_b(q_resid) -> [Hi, D], k_idx = LayerNorm(wk(h)) -> D, RoPE on the first `rope` dims
(interleaved for GLM, rotate-half for DeepSeek-V3.2), the FP8 indexer-K write, and the per-head weights
weights_proj(h) * Hi^-0.5 * D^-0.5. Shared layers reuse the slots this returns (stage 6, "indexer /
reuse"). Slots are translated once here, so shared layers do no page-table work.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.config import ModelConfig
from dsaserve.engine.counters import COUNTERS
from dsaserve.ledger.causal import keys_scored
from dsaserve.model.layers.context import StepContext
from dsaserve.model.layers.linear import Linear
from dsaserve.model.layers.norm import LayerNorm
from dsaserve.weights.spec import is_not_converted


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str):
        super().__init__()
        self.n_heads, self.head_dim, self.rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.interleaved = cfg.model_type == "glm_moe_dsa"  # DeepSeek-V3.2's indexer RoPE is rotate-half
        q = lambda name: not is_not_converted(cfg, f"{prefix}.{name}")  # noqa: E731
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, q("wq_b"))
        self.wk = Linear(cfg.hidden_size, self.head_dim, q("wk"))
        self.k_norm = LayerNorm(self.head_dim)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, q("weights_proj"))
        self.layer_id = -1

    def _rope(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        rot = ctx.ops.apply_rope(x[..., : self.rope], ctx.cos, ctx.sin, self.interleaved)
        return torch.cat([rot, x[..., self.rope:]], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        b, t = ctx.batch, x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), ctx)
        k = self._rope(self.k_norm(self.wk(x)), ctx)
        cache = ctx.pool.index_cache(self.layer_id)
        ctx.ops.indexer_k_write(cache, ctx.pool.layout, b.out_cache_loc, k)
        COUNTERS.add("indexer_bytes_written", t * ctx.pool.idx_bpt)
        # HF applies softmax_scale inside relu and n_heads^-0.5 to the weights; both are positive, so fold them
        w = self.weights_proj(x).float() * (self.n_heads ** -0.5 * self.head_dim ** -0.5)
        seq_lens, ext = b.host_lens()
        COUNTERS.add("indexer_bytes_read", sum(keys_scored(s - n, n) for s, n in zip(seq_lens, ext, strict=True))
                     * ctx.pool.idx_bpt)
        return ctx.ops.indexer_topk(q, w, cache, ctx.pool.layout, b.page_table, b.req_index, b.positions,
                                    self.topk, b.page_size, seq_lens, ext)

