"""The checkpoint's tensor inventory: every name, shape and storage dtype a real HF FP8 checkpoint of a
ModelConfig holds.

Owns: the single source of truth for what is on disk. `make-checkpoint` writes exactly this list; the
loader's coverage check compares the index against it; the ledger's weight-byte terms can sum it.
Layout (DeepSeek-V3 / GLM-5 FP8 releases): linear weights FP8 e4m3 with a float32 `weight_scale_inv` of
shape ceil(N/128) x ceil(K/128); `quantization_config.modules_to_not_convert` modules in BF16, the router's
`e_score_correction_bias` in FP32; per-expert tensors; the indexer only on "full" layers; MTP layers at
index num_hidden_layers.. with `eh_proj`, `enorm`, `hnorm`, `shared_head.norm` and a full decoder layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.config import FP8_BLOCK, ModelConfig, is_not_converted


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # "fp8" (float8_e4m3fn), "bf16", "fp32"

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * {"fp8": 1, "bf16": 2, "fp32": 4}[self.dtype]


def scale_shape(shape: tuple[int, int]) -> tuple[int, int]:
    """weight_scale_inv shape for an (N, K) FP8 weight: one float32 per 128x128 block."""
    n, k = shape
    return (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))


def _linear(cfg: ModelConfig, module: str, out_f: int, in_f: int) -> list[TensorSpec]:
    if is_not_converted(cfg, module):
        return [TensorSpec(f"{module}.weight", (out_f, in_f), "bf16")]
    return [TensorSpec(f"{module}.weight", (out_f, in_f), "fp8"),
            TensorSpec(f"{module}.weight_scale_inv", scale_shape((out_f, in_f)), "fp32")]


def _norm(module: str, dim: int, bias: bool = False) -> list[TensorSpec]:
    out = [TensorSpec(f"{module}.weight", (dim,), "bf16")]
    if bias:
        out.append(TensorSpec(f"{module}.bias", (dim,), "bf16"))
    return out


def _mlp(cfg: ModelConfig, prefix: str, inter: int) -> list[TensorSpec]:
    h = cfg.hidden_size
    return (_linear(cfg, f"{prefix}.gate_proj", inter, h) + _linear(cfg, f"{prefix}.up_proj", inter, h)
            + _linear(cfg, f"{prefix}.down_proj", h, inter))


def decoder_layer_specs(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    h, p = cfg.hidden_size, f"model.layers.{layer}"
    a = f"{p}.self_attn"
    out = _norm(f"{p}.input_layernorm", h) + _norm(f"{p}.post_attention_layernorm", h)
    out += _linear(cfg, f"{a}.q_a_proj", cfg.q_lora_rank, h) + _norm(f"{a}.q_a_layernorm", cfg.q_lora_rank)
    out += _linear(cfg, f"{a}.q_b_proj", cfg.num_attention_heads * cfg.qk_head_dim, cfg.q_lora_rank)
    out += _linear(cfg, f"{a}.kv_a_proj_with_mqa", cfg.kv_latent_dim, h)
    out += _norm(f"{a}.kv_a_layernorm", cfg.kv_lora_rank)
    out += _linear(cfg, f"{a}.kv_b_proj", cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                   cfg.kv_lora_rank)
    out += _linear(cfg, f"{a}.o_proj", h, cfg.num_attention_heads * cfg.v_head_dim)
    if cfg.is_full_indexer(layer):
        i = f"{a}.indexer"
        out += _linear(cfg, f"{i}.wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        out += _linear(cfg, f"{i}.wk", cfg.index_head_dim, h)
        out += _norm(f"{i}.k_norm", cfg.index_head_dim, bias=True)
        out += _linear(cfg, f"{i}.weights_proj", cfg.index_n_heads, h)
    if cfg.is_moe(layer):
        m = f"{p}.mlp"
        out += [TensorSpec(f"{m}.gate.weight", (cfg.n_routed_experts, h), "bf16"),
                TensorSpec(f"{m}.gate.e_score_correction_bias", (cfg.n_routed_experts,), "fp32")]
        for j in range(cfg.n_routed_experts):
            out += _mlp(cfg, f"{m}.experts.{j}", cfg.moe_intermediate_size)
        if cfg.n_shared_experts:
            out += _mlp(cfg, f"{m}.shared_experts", cfg.moe_intermediate_size * cfg.n_shared_experts)
    else:
        out += _mlp(cfg, f"{p}.mlp", cfg.intermediate_size)
    return out


def mtp_layer_specs(cfg: ModelConfig, layer: int) -> list[TensorSpec]:
    h, p = cfg.hidden_size, f"model.layers.{layer}"
    out = _norm(f"{p}.enorm", h) + _norm(f"{p}.hnorm", h) + _linear(cfg, f"{p}.eh_proj", h, 2 * h)
    out += _norm(f"{p}.shared_head.norm", h)
    return out + decoder_layer_specs(cfg, layer)


def checkpoint_specs(cfg: ModelConfig) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in a stable order (embedding, layers, MTP layers, norm, lm_head)."""
    out = [TensorSpec("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size), "bf16")]
    for i in range(cfg.num_hidden_layers):
        out += decoder_layer_specs(cfg, i)
    for i in cfg.mtp_layer_ids:
        out += mtp_layer_specs(cfg, i)
    out += _norm("model.norm", cfg.hidden_size)
    if not cfg.tie_word_embeddings:
        out.append(TensorSpec("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), "bf16"))
    return out
