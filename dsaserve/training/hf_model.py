"""The trainable model: HF transformers' GlmMoeDsaForCausalLM plus the pieces HF leaves out for training.

Owns: building the HF model from a dsaserve ModelConfig, and three additions that make it train like
GLM-5 / DeepSeek-V3.2 rather than like a plain causal LM:
  - the MTP layer (HF ignores layer N): enorm(embed(t+1)) || hnorm(hidden(t)) -> eh_proj -> one decoder
    layer (HF's own class) -> shared_head.norm -> the shared lm_head, trained on token t+2 — exactly
    dsaserve's `MTPLayer.forward_mtp` (hidden = the main stack's output after model.norm);
  - indexer training: HF's indexer runs under no_grad (its top-k is not differentiable), so its weights
    would stay random. As in DSA, the indexer is trained by a KL divergence towards the main attention's
    distribution (summed over heads, averaged over the full layer and the shared layers that reuse its
    top-k), on detached inputs so this loss reaches only the indexer; over the selected set once sparse,
    over every causal position during the dense warm-up (`set_index_topk`);
  - load balancing as DeepSeek-V3: after each step every router's e_score_correction_bias moves by
    `rate * sign(mean load - load)` (HF keeps it as a buffer and never updates it), plus the complementary
    balance loss sum_i f_i P_i (f_i: expert i's share of the picks x E/K, P_i: its mean normalised score),
    here over the whole batch and with a larger weight: in a run of minutes Adam grows the router weights
    faster than a bias alone can follow, and all tokens end up with the same two experts.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.config import ModelConfig


def hf_config(cfg: ModelConfig, **overrides):
    """GlmMoeDsaConfig of cfg (eager attention: the indexer loss reads the attention probabilities)."""
    import transformers

    raw = cfg.to_hf_dict()
    raw.pop("quantization_config", None)
    raw.update(overrides)
    config = transformers.GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # HF's per-expert loop: 8 experts, and no kernel to trust untested
    return config


def _mtp_layer_config(cfg: ModelConfig):
    """A one-layer config for HF's decoder layer class: MTP layers are MoE and run their own indexer."""
    return hf_config(cfg, num_hidden_layers=1, mlp_layer_types=["sparse"], indexer_types=["full"],
                     first_k_dense_replace=0)


def _mtp_class():
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaDecoderLayer, GlmMoeDsaRMSNorm

    class MTPLayer(GlmMoeDsaDecoderLayer):
        """Module names as in the checkpoint's `model.layers.N.*` (decoder layer + enorm/hnorm/eh_proj/shared_head)."""

        def __init__(self, config):
            super().__init__(config, 0)
            h, eps = config.hidden_size, config.rms_norm_eps
            self.enorm, self.hnorm = GlmMoeDsaRMSNorm(h, eps), GlmMoeDsaRMSNorm(h, eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)
            self.shared_head = nn.Module()
            self.shared_head.norm = GlmMoeDsaRMSNorm(h, eps)

        def forward_mtp(self, next_embeds: torch.Tensor, hidden: torch.Tensor, position_embeddings,
                        mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            h = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
            out = self(h, attention_mask=mask, position_embeddings=position_embeddings, position_ids=position_ids)
            return self.shared_head.norm(out[0] if isinstance(out, tuple) else out)

    return MTPLayer


def causal_mask(s: int, device: torch.device) -> torch.Tensor:
    """[1, 1, s, s] additive mask (0 on and below the diagonal, -inf above), as HF's eager path takes it."""
    return torch.full((s, s), float("-inf"), device=device).triu(1)[None, None]


@dataclass
class Losses:
    lm: torch.Tensor
    mtp: torch.Tensor | None
    indexer_kl: torch.Tensor | None
    mtp_correct: torch.Tensor | None = None  # MTP argmax == token t+2 (an acceptance proxy on real text)


class MiniLM(nn.Module):
    """`lm` (HF GlmMoeDsaForCausalLM) + `mtp` (layer N). `forward(x)` with x [B, S+1] gives the losses."""

    def __init__(self, cfg: ModelConfig, train_indexer: bool = True):
        super().__init__()
        import transformers

        self.cfg = cfg
        self.lm = transformers.GlmMoeDsaForCausalLM(hf_config(cfg))
        self.mtp = _mtp_class()(_mtp_layer_config(cfg)) if cfg.num_nextn_predict_layers else None
        if self.mtp is not None:  # HF's initialiser for the layer it does not know about
            for m in self.mtp.modules():
                self.lm._init_weights(m)
        self.attn_layers = list(self.lm.model.layers) + ([self.mtp] if self.mtp is not None else [])
        self.indexer = IndexerDistill(self) if train_indexer else None

    def set_index_topk(self, k: int) -> None:
        for layer in self.attn_layers:
            if layer.self_attn.indexer is not None:
                layer.self_attn.indexer.index_topk = k

    def forward(self, x: torch.Tensor, mtp_weight: float = 0.3) -> Losses:
        inp, tgt = x[:, :-1], x[:, 1:]
        s = inp.shape[1]
        if self.indexer is not None:
            self.indexer.clear()
        hidden = self.lm.model(input_ids=inp, use_cache=False).last_hidden_state  # after model.norm
        logits = self.lm.lm_head(hidden)
        lm = F.cross_entropy(logits.float().flatten(0, 1), tgt.flatten())
        mtp = correct = None
        if self.mtp is not None and s > 2:
            pos = torch.arange(s - 1, device=x.device)[None]
            pe = self.lm.model.rotary_emb(hidden, pos)
            h = self.mtp.forward_mtp(self.lm.model.embed_tokens(inp[:, 1:]), hidden[:, :-1], pe,
                                     causal_mask(s - 1, x.device), pos)
            mtp_logits = self.lm.lm_head(h).float()
            mtp = F.cross_entropy(mtp_logits.flatten(0, 1), x[:, 2:].flatten())
            correct = (mtp_logits.argmax(-1) == x[:, 2:]).float().mean()
        kl = self.indexer.loss() if self.indexer is not None and self.training else None
        return Losses(lm, mtp, kl, correct)


def _indexer_scores(self, hidden_states, q_resid, position_embeddings, attention_mask):
    """HF GlmMoeDsaIndexer's scores [B, S, T] (same arithmetic), with autograd on, from detached inputs."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import apply_rotary_pos_emb_interleave

    b, s, _ = hidden_states.shape
    hs, qr = hidden_states.detach(), q_resid.detach()
    cos, sin = position_embeddings
    rope, d = self.qk_rope_head_dim, self.head_dim
    q_rot, q_pass = torch.split(self.wq_b(qr).view(b, s, self.n_heads, d), [rope, d - rope], dim=-1)
    k_rot, k_pass = torch.split(self.k_norm(self.wk(hs)).unsqueeze(2), [rope, d - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], dim=-1), torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    # one GEMM per sequence ([S*H, D] x [D, T]) instead of HF's broadcast, which materialises K S times
    scores = torch.bmm(q.reshape(b, s * self.n_heads, d).float(), k.transpose(-1, -2).float())
    scores = F.relu(scores.view(b, s, self.n_heads, -1) * self.softmax_scale)  # [B, S, H, T] as in HF
    weights = self.weights_proj(hs.to(self.weights_proj.weight.dtype)).float() * (self.n_heads ** -0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if attention_mask.dtype == torch.bool:
        return index_scores.masked_fill(~attention_mask, float("-inf"))
    return index_scores + attention_mask


def _training_indexer_forward(self, hidden_states, q_resid, position_embeddings, attention_mask,
                              position_ids=None, past_key_values=None):
    if past_key_values is not None:
        raise RuntimeError("the training indexer runs without a KV cache")
    scores = _indexer_scores(self, hidden_states, q_resid, position_embeddings, attention_mask)
    topk = scores.detach().topk(min(self.index_topk, scores.shape[-1]), dim=-1).indices.to(torch.int32)
    if torch.is_grad_enabled():
        self.captured = (scores, topk)
    return topk


class IndexerDistill:
    """Hooks that capture each layer's attention probabilities and each full layer's indexer scores, and
    the KL loss between them (see the module docstring)."""

    def __init__(self, model: MiniLM):
        self.groups: list[list[int]] = []  # [full layer, shared layers reusing its top-k...]
        self.probs: dict[int, torch.Tensor] = {}
        self.indexers = {}
        for i, layer in enumerate(model.attn_layers):
            attn = layer.self_attn
            if attn.indexer is not None:
                self.groups.append([i])
                attn.indexer.forward = types.MethodType(_training_indexer_forward, attn.indexer)
                self.indexers[i] = attn.indexer
            else:
                self.groups[-1].append(i)
            attn.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(_module, _inp, out):
            if torch.is_grad_enabled() and out[1] is not None:
                # sum over heads of the (renormalised) softmax: one distribution over keys per query
                self.probs[i] = out[1].detach().float().mean(1)
        return hook

    def clear(self) -> None:
        self.probs.clear()
        for ix in self.indexers.values():
            ix.captured = None

    def loss(self) -> torch.Tensor | None:
        total = None
        for group in self.groups:
            captured = self.indexers[group[0]].captured
            probs = [self.probs[i] for i in group if i in self.probs]
            if captured is None or not probs:
                continue
            kl = indexer_kl(*captured, torch.stack(probs).mean(0))
            total = kl if total is None else total + kl
        return total


def indexer_kl(scores: torch.Tensor, topk: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(scores)) over each query's selected, causal keys; mean over queries."""
    s, t = scores.shape[-2:]
    causal = torch.ones(s, t, dtype=torch.bool, device=scores.device).tril(t - s)
    sel = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, topk.long(), True) & causal
    p = target * sel
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)
    logq = torch.log_softmax(scores.masked_fill(~sel, float("-inf")), dim=-1)
    terms = torch.where(p > 0, p * (p.clamp_min(1e-20).log() - logq), torch.zeros_like(p))
    return terms.sum(-1).mean()


def _fp32(forward):
    def run(*args, **kwargs):
        with torch.autocast("cuda", enabled=False):
            return forward(*args, **kwargs)
    return run


class RouterBalancer:
    """Aux-loss-free balancing: count each router's picks during a step, then nudge its bias."""

    def __init__(self, model: MiniLM, rate: float):
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

        self.rate = rate
        self.gates = [m for m in model.modules() if isinstance(m, GlmMoeDsaTopkRouter)]
        self.counts = [torch.zeros(g.num_experts, device=g.weight.device) for g in self.gates]
        self.aux: list[torch.Tensor] = []
        for g, c in zip(self.gates, self.counts, strict=True):
            g.register_forward_hook(self._hook(c))
            g.forward = _fp32(g.forward)  # as dsaserve's router: fp32 logits even under bf16 autocast

    def _hook(self, counts: torch.Tensor):
        def hook(module, _inp, out):
            if not torch.is_grad_enabled():
                return
            logits, _, idx = out
            picks = torch.bincount(idx.flatten(), minlength=counts.numel()).to(counts.dtype)
            counts.add_(picks)
            scores = logits.sigmoid()
            share = (scores / scores.sum(-1, keepdim=True)).mean(0)  # P_i
            f = picks * module.num_experts / max(idx.numel(), 1)  # f_i: 1.0 each when balanced
            self.aux.append((f * share).sum())
        return hook

    def pop_aux(self) -> torch.Tensor | None:
        """The balance loss of the forward since the last call, averaged over the MoE layers (1.0 = balanced)."""
        aux, self.aux = self.aux, []
        return torch.stack(aux).mean() if aux else None

    @torch.no_grad()
    def step(self) -> float:
        """Update every bias; returns the worst max/mean load ratio seen this step (1.0 = balanced)."""
        worst = 1.0
        for g, c in zip(self.gates, self.counts, strict=True):
            if c.sum() == 0:
                continue
            g.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)
            worst = max(worst, float(c.max() / c.mean()))
            c.zero_()
        return worst
