"""Weight bytes: what the checkpoint holds, what each GPU stores under a deployment, and what one forward
reads.

Owns: grouping `weights/spec.checkpoint_specs` (the on-disk inventory: FP8 + scales, BF16, FP32) into
groups whose sharding rule is one line each (replicated A-projections, TP-split attention, EP- or
TP-split routed experts, ...), parameter counts (total, active per token), and the per-step weight read
(routed experts only as far as the step's tokens touch them). Startup-chain step it predicts: "load
weights"; request-path stage: 6 (every GEMM's weight read). Pure Python.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

from dsaserve.common.causal import keys_within_topk
from dsaserve.config import ModelConfig
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.weights.spec import checkpoint_specs

# group -> (regex on the name inside a layer, why it is sharded the way `divisor` says)
GROUPS: dict[str, str] = {
    "embed": "vocab-parallel lookup (a gather: no weight read per step)",
    "lm_head": "vocab-parallel GEMM for the logits rows",
    "final_norm": "final RMSNorm",
    "layer_norms": "input/post-attention RMSNorm, replicated",
    "attn_a": "q_a / kv_a projections + their norms: small, replicated on every rank (note 000)",
    "attn_b": "q_b / kv_b / o_proj: split by heads under attention TP, replicated under DP-attention",
    "indexer": "indexer wq_b / wk / k_norm / weights_proj (full layers), replicated",
    "router": "router gate + e_score_correction_bias, replicated",
    "experts": "routed experts: E/EP whole experts per rank under EP, else 1/TP of every expert",
    "shared": "shared expert: split by moe_dense_tp_size",
    "dense_mlp": "dense-layer MLP (first_k_dense_replace): split by moe_dense_tp_size",
    "mtp_extra": "MTP eh_proj / enorm / hnorm / shared_head.norm",
}
_RULES = [
    ("experts", re.compile(r"\.mlp\.experts\.\d+\.")), ("shared", re.compile(r"\.mlp\.shared_experts\.")),
    ("router", re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")),
    ("dense_mlp", re.compile(r"\.mlp\.(gate|up|down)_proj\.")), ("indexer", re.compile(r"\.indexer\.")),
    ("attn_a", re.compile(r"\.(q_a_proj|kv_a_proj_with_mqa|q_a_layernorm|kv_a_layernorm)\.")),
    ("attn_b", re.compile(r"\.(q_b_proj|kv_b_proj|o_proj)\.")),
    ("layer_norms", re.compile(r"\.(input_layernorm|post_attention_layernorm)\.")),
    ("mtp_extra", re.compile(r"\.(enorm|hnorm|eh_proj|shared_head\.norm)\.")),
]

# the indexer's query projections: a step within the top-k does not run them (`common/causal.takes_every_key`)
_INDEXER_QUERY = re.compile(r"\.indexer\.(wq_b|weights_proj)\.")


@dataclass
class WeightInventory:
    """Bytes and parameters per group; `mtp.<group>` keys hold the MTP layer's share."""

    bytes: dict[str, int] = field(default_factory=dict)
    params: dict[str, int] = field(default_factory=dict)
    query_bytes: dict[str, int] = field(default_factory=dict)  # of "indexer" / "mtp.indexer": wq_b + weights_proj
    query_params: dict[str, int] = field(default_factory=dict)  # the same tensors' parameters (no scales)
    kv_b: dict[str, tuple[int, int]] = field(default_factory=dict)  # of "attn_b" / "mtp.attn_b": kv_b (bytes, params)
    expert_bytes: int = 0  # one routed expert of one layer, FP8 + scales
    expert_params: int = 0
    moe_layers: int = 0
    num_tensors: int = 0

    def main(self, group: str) -> int:
        return self.bytes.get(group, 0)

    def total_bytes(self, mtp: bool = True) -> int:
        return sum(v for k, v in self.bytes.items() if mtp or not k.startswith("mtp."))

    def total_params(self, mtp: bool = True) -> int:
        return sum(v for k, v in self.params.items() if mtp or not k.startswith("mtp."))


def group_of(name: str) -> str:
    if name.startswith("model.embed_tokens."):
        return "embed"
    if name.startswith("lm_head."):
        return "lm_head"
    if name.startswith("model.norm."):
        return "final_norm"
    for group, rx in _RULES:
        if rx.search(name):
            return group
    raise ValueError(f"weights: tensor {name!r} fits no ledger group")


_CACHE: dict[str, WeightInventory] = {}


def inventory(cfg: ModelConfig) -> WeightInventory:
    """Group the checkpoint's tensors (cached per config: GLM-5.3 has ~119k tensors)."""
    key = json.dumps(cfg.to_hf_dict(), sort_keys=True)
    if key in _CACHE:
        return _CACHE[key]
    inv = WeightInventory(moe_layers=len(cfg.moe_layers))
    mtp_prefixes = tuple(f"model.layers.{i}." for i in cfg.mtp_layer_ids)
    first_moe = cfg.moe_layers[0] if cfg.moe_layers else None
    for t in checkpoint_specs(cfg):
        group = group_of(t.name)
        key_ = ("mtp." if t.name.startswith(mtp_prefixes) else "") + group
        inv.bytes[key_] = inv.bytes.get(key_, 0) + t.nbytes
        if _INDEXER_QUERY.search(t.name):
            inv.query_bytes[key_] = inv.query_bytes.get(key_, 0) + t.nbytes
            if not t.name.endswith("_scale_inv"):
                inv.query_params[key_] = inv.query_params.get(key_, 0) + math.prod(t.shape)
        if ".kv_b_proj." in t.name:
            b, n = inv.kv_b.get(key_, (0, 0))
            inv.kv_b[key_] = (b + t.nbytes, n + (0 if t.name.endswith("_scale_inv") else math.prod(t.shape)))
        if not t.name.endswith("_scale_inv"):
            inv.params[key_] = inv.params.get(key_, 0) + math.prod(t.shape)
        if first_moe is not None and t.name.startswith(f"model.layers.{first_moe}.mlp.experts.0."):
            inv.expert_bytes += t.nbytes
            inv.expert_params += 0 if t.name.endswith("_scale_inv") else math.prod(t.shape)
        inv.num_tensors += 1
    _CACHE[key] = inv
    return inv


def divisor(group: str, dep: Deployment, asm: Assumptions) -> int:
    """How many ranks share one copy of a group (1 = replicated on every rank)."""
    g = group.removeprefix("mtp.")
    if dep.dp_attention and asm.engine_dp and g != "experts":
        return 1  # dsaserve's DP-attention: everything but the routed experts is whole on every rank
    if g == "experts":
        return dep.ep if dep.ep > 1 else dep.tp
    if g == "attn_b":
        return dep.attn_tp
    if g in ("shared", "dense_mlp"):
        return asm.moe_dense_tp_size or dep.tp
    if g == "lm_head":
        return dep.tp
    if g == "embed":
        return 1 if dep.dp_attention else dep.tp
    return 1


def stored_per_gpu(inv: WeightInventory, dep: Deployment, asm: Assumptions) -> dict[str, float]:
    """Bytes of each group one GPU holds (the MTP layer only when speculation is on); kv_b as `absorbed_heads`."""
    return {g: held_bytes(inv, g, asm) / divisor(g, dep, asm) for g in inv.bytes
            if asm.speculative or not g.startswith("mtp.")}


def held_bytes(inv: WeightInventory, group: str, asm: Assumptions) -> int:
    """A group's bytes as the engine holds them: the checkpoint's, but with `absorbed_heads` bf16 kv_b as the bf16
    W_uk / W_uv it is absorbed into (2 B a value, its FP8 scales gone)."""
    b = inv.bytes[group]
    if asm.absorbed_heads == "bf16" and group in inv.kv_b:
        kv_bytes, kv_params = inv.kv_b[group]
        b += 2 * kv_params - kv_bytes
    return b


def experts_touched_fraction(cfg: ModelConfig, tokens: int, routing: str) -> float:
    """Expected share of routed experts a step with `tokens` tokens reads (uniform top-k routing:
    a given expert is missed by one token with probability 1 - k/E)."""
    if routing == "all" or tokens <= 0:
        return 1.0 if tokens > 0 else 0.0
    return 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.n_routed_experts) ** tokens


def step_read_per_gpu(cfg: ModelConfig, inv: WeightInventory, dep: Deployment, asm: Assumptions,
                      tokens: int, routing: str | None = None, context: int | None = None) -> dict[str, float]:
    """Weight bytes one GPU reads in one forward over `tokens` tokens (the whole deployment's tokens:
    under EP every rank's experts see the global batch). Embedding rows are a gather, not a read. `context`: a decode
    step's keys a request; within the top-k its full layers skip the indexer's query projections."""
    frac = experts_touched_fraction(cfg, tokens, routing or asm.expert_routing)
    every_key = context is not None and keys_within_topk(context, asm.page_size, cfg.index_topk)
    skipped = query_bytes_per_gpu(inv, dep, asm) if every_key else {}
    out: dict[str, float] = {}
    for g, b in stored_per_gpu(inv, dep, asm).items():
        if g.removeprefix("mtp.") == "embed":
            continue
        out[g] = (b * frac if g.removeprefix("mtp.") == "experts" else b) - skipped.get(g, 0)
    return out


def query_bytes_per_gpu(inv: WeightInventory, dep: Deployment, asm: Assumptions) -> dict[str, float]:
    """One GPU's share of the indexer's query projections (wq_b, weights_proj) by group: what a forward within
    the top-k does not read (`common/causal.takes_every_key`)."""
    return {g: b / divisor(g, dep, asm) for g, b in inv.query_bytes.items()}


def gemm_params_per_token(cfg: ModelConfig, inv: WeightInventory, mtp: bool = False) -> int:
    """Parameters one token multiplies through (no embedding, no lm_head, no norms): attention, indexer on
    full layers, router, k routed + shared experts, dense MLPs — the '40B active' of the notes minus lm_head."""
    groups = ("attn_a", "attn_b", "indexer", "router", "shared", "dense_mlp")
    p = sum(inv.params.get(g, 0) for g in groups) - _vector_params(cfg)
    p += inv.moe_layers * cfg.num_experts_per_tok * inv.expert_params
    if mtp:
        p += sum(inv.params.get(f"mtp.{g}", 0) for g in (*groups, "mtp_extra"))
        p += len(cfg.mtp_layer_ids) * cfg.num_experts_per_tok * inv.expert_params
    return p


def query_params_per_token(inv: WeightInventory, mtp: bool = False) -> int:
    """Of `gemm_params_per_token`, the indexer's query projections: a forward within the top-k skips them."""
    return inv.query_params.get("indexer", 0) + (inv.query_params.get("mtp.indexer", 0) if mtp else 0)


def _vector_params(cfg: ModelConfig) -> int:
    """1-D params inside the GEMM groups above: q_a / kv_a RMSNorm, indexer k_norm (weight + bias), and the
    router's e_score_correction_bias (selection only, no multiply-add)."""
    main = cfg.num_hidden_layers * (cfg.q_lora_rank + cfg.kv_lora_rank)
    return main + len(cfg.full_indexer_layers) * 2 * cfg.index_head_dim + len(cfg.moe_layers) * cfg.n_routed_experts


def active_params_per_token(cfg: ModelConfig, inv: WeightInventory) -> int:
    """GEMM params per token + lm_head (the model card's 'A40B' counts the output projection)."""
    return gemm_params_per_token(cfg, inv) + inv.params.get("lm_head", 0)
