"""DSA lightning indexer (full layers): score every visible key, keep the top-k as physical slots.

Owns: q_idx = wq_b(q_resid) -> [Hi, D], k_idx = LayerNorm(wk(h)) -> D, RoPE on the first `rope` dims
(interleaved for GLM, rotate-half for DeepSeek-V3.2), the FP8 indexer-K write, and the per-head weights
weights_proj(h) * Hi^-0.5 * D^-0.5. Shared layers reuse the slots this returns (stage 6, "indexer /
reuse"). Slots are translated once here, so shared layers do no page-table work. Two entry points, no
forward: `prepare` (every GEMM, the K write) on the compute stream, then `select` (scores + top-k), which
MLAAttention may put on a side stream. A batch within the top-k (`StepContext.all_keys`) makes no queries: its
top-k is every key, selected once a step (`MLAAttention._selects`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dsaserve.config import ModelConfig, is_not_converted
from dsaserve.model.layers.context import StepContext
from dsaserve.model.layers.linear import Linear
from dsaserve.model.layers.norm import LayerNorm

# A/B switch (bench/profile_decode.py "idx_queries"): False computes the queries of a batch within the top-k too
SKIP_QUERIES_FOR_ALL_KEYS = True


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
        self.weight_scale = (self.n_heads * self.head_dim) ** -0.5  # = Hi^-0.5 x D^-0.5 (fp32-identical)
        self.scale_folded = 1.0  # the factor already multiplied into weights_proj (finalize_scale)
        self.layer_id = -1

    def finalize_scale(self) -> None:
        """GPU path, after loading: HF applies softmax_scale inside relu and n_heads^-0.5 to the weights; both
        are positive, so they fold into one factor, and when it is a power of two (GLM-5.3: 32^-0.5 x
        128^-0.5 = 2^-6) it folds exactly into the bf16 weights_proj weight: no per-step multiply or cast."""
        mant, _ = math.frexp(self.weight_scale)
        if mant == 0.5 and not self.weights_proj.quantized and self.scale_folded == 1.0:
            self.weights_proj.weight.data.mul_(self.weight_scale)
            self.scale_folded = self.weight_scale

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """[T, Hi] per-head weights, both HF scales applied (fp32 on the reference path)."""
        if self.scale_folded != 1.0:
            return self.weights_proj(x)
        return self.weights_proj(x).float() * self.weight_scale

    def prepare(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: StepContext,
                k_raw: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The projections and the indexer-K write -> (q [T, Hi, D], head weights [T, Hi]). k_raw: wk(x) when
        the caller computed it in its merged projection (GPU path). Every GEMM of the indexer is here, so
        `select` may run on a side stream beside the q path (moving these there too was measured slower: bench/
        attempts, forty-first session).
        With ctx.all_keys the key write only, (None, None): the top-k is every key, whatever q would score
        (wq_b and weights_proj, and then q's RoPE was a launch too: ~10 us a full layer of a batch-1 step,
        bench/RESULTS.md twenty-eighth session)."""
        b = ctx.batch
        k_raw = self.wk(x) if k_raw is None else k_raw
        queries = not (ctx.all_keys and SKIP_QUERIES_FOR_ALL_KEYS)
        # q's RoPE rides in the key write's launch (one launch a full layer fewer), so wq_b runs first
        q = self.wq_b(q_resid).view(x.shape[0], self.n_heads, self.head_dim) if queries else None
        norm = self.k_norm
        ctx.ops.indexer_k_norm_write(ctx.pool.index_cache(self.layer_id), ctx.pool.layout, b.out_cache_loc, k_raw,
                                     norm.weight, norm.bias, norm.eps, ctx.cos, ctx.sin, self.rope, self.interleaved,
                                     q)
        return (q, self.head_weights(x)) if queries else (None, None)

    def select(self, q: torch.Tensor | None, w: torch.Tensor | None, ctx: StepContext) -> torch.Tensor:
        """Scores over the paged indexer cache and the top-k -> [T, index_topk] physical slots, -1 padded.
        q and w None (`prepare` under ctx.all_keys): every key each row sees, no scores."""
        b, cache = ctx.batch, ctx.pool.index_cache(self.layer_id)
        seq_lens, ext = b.host_lens()
        return ctx.ops.indexer_topk(q, w, cache, ctx.pool.layout, b.page_table, b.req_index, b.positions,
                                    self.topk, b.page_size, seq_lens, ext)

