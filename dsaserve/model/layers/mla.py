"""MLA attention with DSA sparse selection, over the paged latent cache (stage 6).

Owns: q = q_b(norm(q_a(h))) split into nope/rope; latent = kv_a(h) -> RMSNorm(512 nope) | RoPE(64 rope)
written to the pool; the indexer (full layers; within the top-k the first one's every-key selection serves the
rest) or the reused top-k slots (shared layers); sparse MLA over the
cache (a large prefill's pages staged first, `prefill_staging`); and weight absorption: q_nope is folded through
W_uk so attention runs on the 576-dim latent, and the attended latent goes through W_uv before o_proj. Absorbed
and expanded forms are the same math (HF expands K/V).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dsaserve.config import ModelConfig, is_not_converted
from dsaserve.distributed.parallel_state import get_parallel_state
from dsaserve.kernels.registry import get_ops
from dsaserve.model.layers import prefill_staging
from dsaserve.model.layers.context import StepContext
from dsaserve.model.layers.indexer import Indexer
from dsaserve.model.layers.linear import Linear, MergedLinear
from dsaserve.model.layers.norm import RMSNorm
from dsaserve.model.layers.parallel_linear import column_parallel, row_parallel
from dsaserve.model.layers.rope import mla_softmax_scale


@dataclass
class AttentionInputs:
    """What one layer's attention core reads, made by `pre_attention` (a segment's outputs under piecewise
    CUDA graphs: views of the first rows are what a smaller batch's core reads, `rows`)."""

    q_abs: torch.Tensor  # [T, H, kv_lora]: q_nope through W_uk
    q_rope: torch.Tensor  # [T, H, rope], RoPE applied
    latent: torch.Tensor  # [T, H, kv_lora]: the core's output
    q_idx: torch.Tensor | None  # full layers: the indexer's query [T, Hi, D] and head weights [T, Hi]
    w_idx: torch.Tensor | None
    selecting: bool = False  # the selection already runs on ctx.side_stream: the core joins it

    def rows(self, n: int) -> AttentionInputs:
        cut = lambda t: None if t is None else t[:n]  # noqa: E731
        return AttentionInputs(self.q_abs[:n], self.q_rope[:n], self.latent[:n], cut(self.q_idx), cut(self.w_idx),
                               self.selecting)


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        prefix = f"model.layers.{layer_id}.self_attn"
        q = lambda name: not is_not_converted(cfg, f"{prefix}.{name}")  # noqa: E731
        self.layer_id, self.cfg = layer_id, cfg
        self.n_heads, self.nope, self.rope, self.v_dim = (cfg.num_attention_heads, cfg.qk_nope_head_dim,
                                                          cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.kv_lora = cfg.kv_lora_rank
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, q("q_a_proj"))
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = column_parallel(cfg.q_lora_rank, self.n_heads * cfg.qk_head_dim, q("q_b_proj"),
                                        f"{prefix}.q_b_proj")  # TP: split by head
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_latent_dim, q("kv_a_proj_with_mqa"))
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = column_parallel(cfg.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), q("kv_b_proj"),
                                         f"{prefix}.kv_b_proj")
        self.o_proj = row_parallel(self.n_heads * self.v_dim, cfg.hidden_size, q("o_proj"), f"{prefix}.o_proj")
        self.n_heads //= get_parallel_state().tp_size  # this TP rank's heads; latent cache and indexer replicated
        self.indexer = Indexer(cfg, f"{prefix}.indexer") if cfg.is_full_indexer(layer_id) else None
        if self.indexer is not None:
            self.indexer.layer_id = layer_id
        self.softmax_scale = mla_softmax_scale(cfg)
        self.w_uk: torch.Tensor | None = None  # [H, nope, kv_lora], set by absorb()
        self.w_uv_t: torch.Tensor | None = None  # [H, kv_lora, v]
        self.qkv_a: MergedLinear | None = None  # set by merge_projections() on the GPU path

    def absorb(self, dtype: torch.dtype) -> None:
        """Split kv_b_proj into W_uk / W_uv once, after loading (decode never expands K/V)."""
        w = self.kv_b_proj.dense_weight(dtype).view(self.n_heads, self.nope + self.v_dim, self.kv_lora)
        self.w_uk = w[:, : self.nope].contiguous()  # [H, nope, kv_lora]: q_nope [H, T, nope] @ -> [H, T, kv_lora]
        self.w_uv_t = w[:, self.nope:].transpose(1, 2).contiguous()  # [H, kv_lora, v]: latent @ -> [H, T, v]
        self.kv_b_proj.release_weight()

    def merge_projections(self) -> None:
        """GPU path, after loading: q_a, kv_a and (full layers) the indexer's wk read the same hidden state,
        so they become one FP8 GEMM (`MergedLinear`); the separate weights are dropped."""
        parts = [self.q_a_proj, self.kv_a_proj_with_mqa] + ([self.indexer.wk] if self.indexer is not None else [])
        if not MergedLinear.mergeable(parts):
            return
        self.qkv_a = MergedLinear(parts)
        self.q_a_proj = self.kv_a_proj_with_mqa = None
        if self.indexer is not None:
            self.indexer.wk = None
            self.indexer.finalize_scale()

    def _project_a(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(q_a(x), kv_a(x), indexer wk(x) or None) — one merged GEMM on the GPU path."""
        if self.qkv_a is not None:
            q_a, kv_a, *k_idx = self.qkv_a(x)
            return q_a, kv_a, k_idx[0] if k_idx else None
        return self.q_a_proj(x), self.kv_a_proj_with_mqa(x), None

    def pre_attention(self, x: torch.Tensor, ctx: StepContext) -> AttentionInputs:
        """Everything before the attention core: the A projections, q_b + RoPE, the latent (and, full layers,
        the indexer K) KV writes, q_nope through W_uk, and the core's output buffer. Per-token ops only (their
        metadata is positions and out_cache_loc), so a piecewise CUDA graph captures them at a fixed token
        count. With ctx.side_stream the full layers' selection starts here, overlapping the q path (q_b,
        RoPE, KV write, W_uk) that sparse MLA also waits for: at batch 1 / 8K context it is one program per
        row (~20 µs on one SM) beside ~20 µs of GEMMs."""
        t, ops = x.shape[0], ctx.ops
        q_a, kv_a, k_idx = self._project_a(x)
        q_resid = self.q_a_layernorm(q_a)
        q_idx = w_idx = None
        if self.indexer is not None:
            q_idx, w_idx = self.indexer.prepare(x, q_resid, ctx, k_idx)
        selecting = self._selects(q_idx, ctx) and ctx.side_stream is not None
        if selecting:
            ctx.side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(ctx.side_stream):
                ctx.topk_slots = self.indexer.select(q_idx, w_idx, ctx)
        q = self.q_b_proj(q_resid).view(t, self.n_heads, self.nope + self.rope)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope:]
        # q's RoPE rides in the KV write's launch (one launch a layer fewer; the same roundings as `rope_inplace`)
        ops.mla_kv_write(ctx.pool.kv_cache(self.layer_id), ctx.pool.layout, ctx.batch.out_cache_loc, kv_a,
                         self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, ctx.cos, ctx.sin, self.kv_lora, q_rope)
        q_abs = ops.head_bmm(q_nope, self.w_uk)  # [T, H, kv_lora]
        # the core's output, allocated here: under piecewise graphs an address fixed at capture, which the
        # segment after the core reads
        latent = torch.empty(q_abs.shape, dtype=q_abs.dtype, device=q_abs.device)
        return AttentionInputs(q_abs, q_rope, latent, q_idx, w_idx, selecting)

    def attention_core(self, a: AttentionInputs, ctx: StepContext) -> None:
        """What depends on the requests' lengths and page tables: the indexer's scores + top-k (full layers;
        shared layers reuse ctx.topk_slots) and sparse MLA over the paged latent cache, into a.latent (a large
        prefill step: over its pages' rows staged as bf16, model/layers/prefill_staging.py). Runs eagerly between
        the segments of a piecewise graph, on the batch's own rows and page-table width."""
        if a.selecting:  # a holds the side stream's inputs (allocated on this stream) past the join, so their
            torch.cuda.current_stream().wait_stream(ctx.side_stream)  # memory is not reused while it reads them
        elif self._selects(a.q_idx, ctx):
            ctx.topk_slots = self.indexer.select(a.q_idx, a.w_idx, ctx)
        elif ctx.topk_slots is None:
            raise RuntimeError(f"layer {self.layer_id}: a shared indexer layer needs an earlier full layer")
        cache, layout, slots = ctx.pool.kv_cache(self.layer_id), ctx.pool.layout, ctx.topk_slots
        staging = prefill_staging.for_step(ctx, self.kv_lora)  # a prefill's rows dequantised once a layer
        if staging is not None:
            cache, layout, slots = staging.stage(ctx.ops, cache, layout, slots, self.kv_lora)
        ctx.ops.sparse_mla_attention(a.q_abs, a.q_rope, cache, layout, slots, self.softmax_scale, self.kv_lora,
                                     out=a.latent, defer_combine=ctx.fold_combine and staging is None,
                                     full_rows=ctx.full_topk and staging is None)

    def _selects(self, q_idx: torch.Tensor | None, ctx: StepContext) -> bool:
        """Whether this layer makes the step's top-k: a full layer with its indexer queries, or under ctx.all_keys
        (no queries) the first full layer, whose every-key selection the later ones reuse (it is the same)."""
        return self.indexer is not None and (q_idx is not None or ctx.topk_slots is None)

    def post_attention(self, latent: torch.Tensor) -> torch.Tensor:
        """The attended latent through W_uv, then o_proj: [T, hidden] (TP: all-reduced by o_proj)."""
        return self.o_proj(get_ops(latent.device).head_bmm(latent, self.w_uv_t, flatten=True))

    def forward(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        a = self.pre_attention(x, ctx)
        self.attention_core(a, ctx)
        return self.post_attention(a.latent)
