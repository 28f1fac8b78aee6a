"""The DSA-MoE model (GLM-5.x `glm_moe_dsa`, DeepSeek-V3.2 `deepseek_v32`) over a paged KV pool.

Owns: the architecture as a diagram reads — embed -> N x [RMSNorm, MLA(+indexer | reused top-k), RMSNorm,
dense MLP | MoE] -> norm -> lm_head — and the MTP layer (enorm(embed(next)) || hnorm(hidden) -> eh_proj ->
one decoder layer -> shared_head.norm -> the shared lm_head). Module names equal checkpoint names, so
the loader's name table is the identity except for the stacked experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from dsaserve.common import envs
from dsaserve.common.counters import COUNTERS
from dsaserve.config import ModelConfig, is_not_converted
from dsaserve.distributed.parallel_state import get_parallel_state, validate_for_model
from dsaserve.kernels.registry import get_ops
from dsaserve.kernels.variants import SELECT_MAX_ROWS
from dsaserve.model.forward_batch import ForwardBatch
from dsaserve.model.layers.context import PagedKV, StepContext, join_side_stream, one_row_past_topk, takes_every_key
from dsaserve.model.layers.embedding import Embedding, LMHead
from dsaserve.model.layers.linear import Linear
from dsaserve.model.layers.mla import AttentionInputs, MLAAttention
from dsaserve.model.layers.moe import DenseMLP, MoE
from dsaserve.model.layers.norm import RMSNorm
from dsaserve.model.layers.rope import RotaryTables
from dsaserve.model.step_counts import ForwardShape, count_step, forward_shape

# a step's placeholder ids, embedding rows and RoPE rows in one launch on one GPU; False: the resolve and two
# `index_select`s (`profile_decode --ab prologue_apart`)
FUSED_PROLOGUE = True


@dataclass
class SegmentCarry:
    """What one segment hands to the next: the residual stream and the layer's attention inputs; after
    the last segment, the final-normed hidden states (in `residual`, attn None)."""

    residual: torch.Tensor
    attn: AttentionInputs | None

    @property
    def hidden(self) -> torch.Tensor:
        return self.residual


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        p = f"model.layers.{layer_id}"
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, layer_id)
        self.mlp = MoE(cfg, f"{p}.mlp") if cfg.is_moe(layer_id) else DenseMLP(cfg, f"{p}.mlp", cfg.intermediate_size)

    def forward(self, h: torch.Tensor, ctx: StepContext,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual stream before it); the caller's next norm adds the two (SGLang's layout:
        each residual add is fused into the norm that follows it). residual None: h is the stream."""
        a, residual = self.open(h, ctx, residual)
        self.self_attn.attention_core(a, ctx)
        return self.close(a, residual, ctx)

    def open(self, h: torch.Tensor, ctx: StepContext,
             residual: torch.Tensor | None) -> tuple[AttentionInputs, torch.Tensor]:
        """The layer up to its attention core: input norm (+ the residual add) and the pre-attention ops."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add_forward(h, residual)
        return self.self_attn.pre_attention(x, ctx), residual

    def close(self, a: AttentionInputs, residual: torch.Tensor,
              ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after its attention core: W_uv + o_proj, residual add + norm, dense MLP / MoE."""
        x, residual = self.post_attention_layernorm.add_forward(self.self_attn.post_attention(a.latent), residual)
        return self.mlp(x, ctx), residual


class MTPLayer(DecoderLayer):
    """Multi-token prediction layer N: predicts token t+2 from hidden(t) and the embedding of token t+1."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        p = f"model.layers.{layer_id}"
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, not is_not_converted(cfg, f"{p}.eh_proj"))
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_mtp(self, next_embeds: torch.Tensor, hidden: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        h = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        return self.shared_head.norm.add_forward(*super().forward(h, ctx))[0]


class Backbone(nn.Module):
    """`model.*` of the checkpoint: embed_tokens, layers (main + MTP), norm."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        layers: list[nn.Module] = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        if with_mtp:
            layers += [MTPLayer(cfg, i) for i in cfg.mtp_layer_ids]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DsaForCausalLM(nn.Module):
    """The whole model. `forward` runs the main stack and returns logits for batch.logits_indices."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool = True):
        super().__init__()
        self.cfg, self.with_mtp = cfg, with_mtp and cfg.num_nextn_predict_layers > 0
        self.parallel = get_parallel_state()  # TP/EP layout the layers were built for (the loader reads it)
        validate_for_model(cfg, self.parallel)
        self.model = Backbone(cfg, self.with_mtp)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:  # one parameter: the loader fills it from model.embed_tokens.weight
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary: RotaryTables | None = None
        self.dtype = torch.float32
        self._side_stream: torch.cuda.Stream | None = None
        self._shapes: dict[int, ForwardShape] = {}  # per forward kind (-1 main, k MTP layer k): step counters

    @property
    def kv_layer_ids(self) -> list[int]:
        return [i for i, _ in enumerate(self.model.layers)]

    def finalize(self, dtype: torch.dtype, device: torch.device, keep_fp8: bool) -> None:
        """After loading: dequantise or keep FP8 per layer, absorb kv_b, build RoPE tables."""
        self.dtype = dtype
        for m in self.modules():
            if isinstance(m, (Linear,)) or hasattr(m, "keep_fp8"):
                m.finalize(dtype, keep_fp8)
            elif hasattr(m, "finalize") and m is not self:
                m.finalize(dtype)
        for m in self.modules():
            if isinstance(m, MLAAttention):
                m.absorb(dtype)
        if keep_fp8:  # GPU path: projections of one input become one GEMM (the reference keeps them apart)
            for m in list(self.modules()):
                if hasattr(m, "merge_projections"):
                    m.merge_projections()
        if self.cfg.tie_word_embeddings:  # finalize made new Parameters: tie them again
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryTables(self.cfg, device)
        self._shapes.clear()  # merged projections: the modules changed (their bytes did not)

    def forward_shape(self, mtp: int = -1) -> ForwardShape:
        """What the main forward (mtp -1) or MTP layer `mtp`'s forward reads whatever the batch (cached)."""
        if mtp not in self._shapes:
            n = self.cfg.num_hidden_layers
            layers = self.model.layers[:n] if mtp < 0 else [self.model.layers[n + mtp]]
            self._shapes[mtp] = forward_shape(layers, self.lm_head, main=mtp < 0)
        return self._shapes[mtp]

    def _context(self, batch: ForwardBatch, pool: PagedKV, rope: bool = True, side_stream: bool = True,
                 whole_forward: bool = True) -> StepContext:
        """rope=False: the RoPE rows are left to segment 0 (inside its graph under piecewise capture).
        whole_forward: the cores run in one flow with the segments around them (`StepContext.fold_combine`), and a
        batch within the top-k skips its indexer queries (`StepContext.all_keys`); not for piecewise segments,
        which serve batches of every width (their own batch is a one-page placeholder)."""
        cos, sin = self.rotary(batch.positions, self.dtype) if rope else (None, None)
        ops = get_ops(batch.input_ids.device)
        stream = self._indexer_stream(batch, ops) if side_stream else None
        return StepContext(batch, pool, cos, sin, ops, side_stream=stream, fold_combine=whole_forward,
                           all_keys=whole_forward and takes_every_key(self.cfg, batch),
                           full_topk=one_row_past_topk(self.cfg, batch))

    def _indexer_stream(self, batch: ForwardBatch, ops) -> torch.cuda.Stream | None:
        """The side stream full layers run their indexer selection on (`MLAAttention.pre_attention`), and MoE layers
        their experts-touched count and an unfused shared expert (`Experts.forward`): GPU kernels and decode-size
        batches only (the Triton selection; a prefill's scores fill the GPU alone).
        DSASERVE_OVERLAP_INDEXER=0 keeps everything on one stream (A/B, bisecting)."""
        if not ops.graph_safe or not envs.DSASERVE_OVERLAP_INDEXER:
            return None
        if batch.num_tokens > SELECT_MAX_ROWS:
            return None
        if self._side_stream is None or self._side_stream.device != batch.input_ids.device:
            # high priority: the selection's programs go first when SMs free up (the GEMMs beside it fill them)
            self._side_stream = torch.cuda.Stream(batch.input_ids.device, priority=-1)
        return self._side_stream

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch, pool: PagedKV) -> torch.Tensor:
        """Main stack; returns final-normed hidden states [T, H] for every token of the batch: the segments
        with each layer's attention core between them (what a piecewise CUDA graph replays, eagerly)."""
        ctx = self._context(batch, pool, rope=False)
        carry = self.segment(0, ctx, None)
        for i in range(self.cfg.num_hidden_layers):
            self.attention_core(i, ctx, carry.attn)
            carry = self.segment(i + 1, ctx, carry)
        join_side_stream(ctx)
        return carry.hidden

    # ---- the forward as segments between attention cores (engine/piecewise_runner.py) -----------
    @property
    def num_segments(self) -> int:
        return self.cfg.num_hidden_layers + 1

    def segment_context(self, batch: ForwardBatch, pool: PagedKV) -> StepContext:
        """The context segments read (input_ids, positions, out_cache_loc; RoPE rows made by segment 0)."""
        return self._context(batch, pool, rope=False, side_stream=False, whole_forward=False)

    def segment(self, i: int, ctx: StepContext, carry: SegmentCarry | None) -> SegmentCarry:
        """Segment i of the main stack, everything between two attention cores: segment 0 = RoPE rows +
        embedding + layer 0 up to its core; segment i = the rest of layer i-1 (o_proj, residual + norm, MLP /
        MoE) + layer i up to its core; the last = the rest of the last layer + the final norm. Per-token ops
        and the collectives of TP / EP: fixed shapes at a fixed token count, so each may be a CUDA graph."""
        layers, n = self.model.layers, self.cfg.num_hidden_layers
        if i == 0:
            h, residual = self._embed_and_rope(ctx), None
        else:
            h, residual = layers[i - 1].close(carry.attn, carry.residual, ctx)
        if i == n:
            return SegmentCarry(self.model.norm.add_forward(h, residual)[0], None)
        attn, residual = layers[i].open(h, ctx, residual)
        return SegmentCarry(residual, attn)

    def _embed_and_rope(self, ctx: StepContext) -> torch.Tensor:
        """The step's embedding rows, its RoPE rows into ctx, the batch's placeholder ids resolved first (where it
        has `future_token_ids`): with the GPU kernels on one GPU one launch does all three (`embed_rope_rows`),
        else each apart (the vocabulary split; the reference ops, whose RoPE rows on the CPU are computed)."""
        ids, positions, future = ctx.batch.input_ids, ctx.batch.positions, ctx.batch.future_token_ids
        embed = self.model.embed_tokens
        if not FUSED_PROLOGUE or embed.group.size != 1 or ctx.ops.impls["embed_rope_rows"] == "reference":
            if future is not None:
                ctx.ops.resolve_placeholders(ids, future)
            ctx.cos, ctx.sin = self.rotary(positions, self.dtype)
            return embed(ids)
        table = self.rotary.table(positions.device, self.dtype)
        h, rows = ctx.ops.embed_rope_rows(ids, embed.weight, positions, table, future)
        ctx.cos, ctx.sin = self.rotary.halves(rows)
        return h

    def attention_core(self, i: int, ctx: StepContext, attn: AttentionInputs) -> None:
        """Layer i's attention core (indexer selection + sparse MLA) on what segment i made (`carry.attn`)."""
        self.model.layers[i].self_attn.attention_core(attn, ctx)

    @torch.inference_mode()
    def forward_idle(self, mtp_layer: int | None = None, dp_rows: int = 0, dp_tokens: tuple[int, ...] = ()) -> None:
        """DP-attention: this rank has no tokens while the others run `forward` (or, with mtp_layer=k,
        `forward_mtp(k=k)`): make exactly the collectives of that forward with zero tokens — per MoE layer
        the count exchange, dispatch and combine, or with `dp_rows` (an eager gather step, engine/dp_step.py)
        the all-gather and reduce-scatter of that many padding rows (nothing else in a DP-attention forward
        communicates) — and run this rank's experts on the others' rows. One rank: nothing to do."""
        if self.parallel.world_size > 1 and not self.parallel.dp_attention:
            raise RuntimeError("forward_idle: only DP-attention ranks run their own batches; TP/EP ranks must "
                               "all run the same forward")
        if mtp_layer is not None and not self.with_mtp:
            raise RuntimeError("forward_idle: this model was built without its MTP layer")
        COUNTERS.add("idle_steps")
        main = self.cfg.num_hidden_layers
        layers = self.model.layers[:main] if mtp_layer is None else [self.model.layers[main + mtp_layer]]
        device = self.model.embed_tokens.weight.device
        ctx = SimpleNamespace(ops=get_ops(device))  # the experts only need the kernels
        for layer in layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.forward_idle(self.dtype, device, ctx, dp_rows, dp_tokens)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden, out)

    def logits_dtype(self) -> torch.dtype:
        return self.lm_head.out_dtype()

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: PagedKV, logits_out: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits [L, V] for batch.logits_indices (the lm_head's dtype: `logits_dtype`; written into `logits_out`
        where given), pre-norm-free final hidden [T, H])."""
        hidden = self.forward_hidden(batch, pool)
        logits = self.compute_logits(_logit_rows(hidden, batch), logits_out)
        count_step(self.forward_shape(), pool, batch)
        return logits, hidden

    @torch.inference_mode()
    def forward_mtp(self, batch: ForwardBatch, pool: PagedKV, prev_hidden: torch.Tensor, k: int = 0,
                    with_hidden: bool = False, logits_out: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """MTP layer k: batch.input_ids are the *next* tokens, prev_hidden the main model's final hidden
        states (after model.norm, as DeepSeek/GLM feed them) at the same positions. Returns logits [L, V] (in
        `logits_out` where given), and with_hidden the layer's own normed output at those rows (what a chained
        draft step feeds it again)."""
        if not self.with_mtp:
            raise RuntimeError("this model was built without its MTP layer (num_nextn_predict_layers=0)")
        layer = self.model.layers[self.cfg.num_hidden_layers + k]
        ctx = self._context(batch, pool, rope=False)
        h = layer.forward_mtp(self._embed_and_rope(ctx), prev_hidden, ctx)
        join_side_stream(ctx)
        rows = _logit_rows(h, batch)
        logits = self.compute_logits(rows, logits_out)
        count_step(self.forward_shape(k), pool, batch)
        return (logits, rows) if with_hidden else logits


def _logit_rows(hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """The rows that produce logits: a decode batch's hidden rows as they are (no gather launch)."""
    return hidden if batch.samples_every_token else hidden[batch.logits_indices]
