"""The ten-stage timeline of one request and the per-layer operator list, decode vs prefill.

Owns: note 001's stage table (stage -> what happens -> CPU/GPU -> dsaserve module, as DESIGN.md maps
it) and its 15-row operator list, with the count of each operator per forward derived from the config
(full vs shared indexer layers, dense vs MoE layers) and the deployment (dispatch/combine only under
EP). The operator count is also the eager kernel-launch count the first-request model charges.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.config import ModelConfig
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.ledger.speculative import drafts


@dataclass(frozen=True)
class Stage:
    no: int
    name: str
    work: str
    side: str  # where it runs
    module: str  # dsaserve modules that exist (tests check every path), or "not built yet" and why
    collective: str  # the collective at this stage, if any


STAGES: tuple[Stage, ...] = (
    Stage(1, "ingress", "OpenAI HTTP, chat template, tokenize", "CPU", "server/api.py, server/tokenizer_manager.py",
          ""),
    Stage(2, "enqueue", "request crosses into the scheduler process (ZMQ + msgpack)", "CPU / IPC", "server/ipc.py",
          ""),
    Stage(3, "schedule", "pick requests, token budget, chunked prefill, KV pages, prefix match", "CPU",
          "engine/scheduler.py, engine/kv_pool.py, engine/prefix_cache.py", ""),
    Stage(4, "batch", "input_ids, positions, out_cache_loc, page table into static buffers", "CPU -> GPU copy",
          "engine/batch.py", ""),
    Stage(5, "embed", "vocab-parallel lookup", "GPU", "model/layers/embedding.py", "embedding all-reduce (TP)"),
    Stage(6, "layers", "RMSNorm, A-proj, norm+RoPE+KV write, indexer / reuse, sparse MLA, MoE", "GPU",
          "model/glm_moe_dsa.py, model/layers/*", "per-layer reductions, MoE dispatch/combine"),
    Stage(7, "speculate", "MTP draft and verify", "GPU",
          "engine/mtp.py (the MTP layer's forward: model/glm_moe_dsa.py)", "as stage 6, for the MTP layer"),
    Stage(8, "lm head", "vocab-parallel GEMM + logits gather", "GPU", "model/layers/embedding.py",
          "vocab all-gather"),
    Stage(9, "sample", "temperature/top-k/top-p, penalties, grammar mask, MTP acceptance", "GPU (+CPU mask)",
          "model/sampler.py, engine/grammar.py",
          ""),
    Stage(10, "output", "incremental detokenize, stop strings, streaming, free/cache KV", "CPU",
          "server/detokenizer_process.py, engine/incremental_detokenizer.py, engine/scheduler.py", ""),
)


@dataclass(frozen=True)
class Operator:
    no: int
    name: str
    decode: int  # occurrences per decode forward
    prefill: int  # occurrences per prefill chunk forward
    fusion: str
    why: str


def operator_list(cfg: ModelConfig, dep: Deployment, asm: Assumptions) -> list[Operator]:
    """Note 001's 15 operators with counts per forward for this config and deployment."""
    n = cfg.num_hidden_layers
    full, moe, dense = len(cfg.full_indexer_layers), len(cfg.moe_layers), len(cfg.dense_layers)
    ep = dep.ep > 1
    mtp = len(cfg.mtp_layer_ids) * drafts(asm)  # one MTP forward a draft (speculative.py)
    reduce_kind = "reduce-scatter" if dep.dp_attention else "all-reduce"
    return [
        Operator(1, "residual add + RMSNorm", n, n, "fused with the previous reduction", "every layer"),
        Operator(2, f"A-projections ({cfg.hidden_size} -> {cfg.q_lora_rank + cfg.kv_latent_dim})", n, n,
                 "one fused q_a/kv_a GEMM", "q_lora_rank + kv_lora_rank + rope"),
        Operator(3, "q_a/kv_a norm + RoPE + KV write", n, n, "fused_norm_rope; full layers also write indexer K",
                 "every layer writes its latent"),
        Operator(4, f"Q up-projection ({cfg.q_lora_rank} -> {cfg.num_attention_heads}x{cfg.qk_head_dim})", n, n,
                 "shares its input with the indexer's wq_b", "every layer"),
        Operator(5, "indexer K projection + scoring", full, full, "scoring and top-k often one kernel",
                 f"{full} full layers; {n - full} shared layers reuse the indices"),
        Operator(6, f"top-k selection ({cfg.index_topk})", full, full, "page-level filter, compact indices",
                 "only where the indexer scored"),
        Operator(7, "sparse MLA attention", n, n, "FlashMLA / FlashInfer sparse", "every layer reads its own KV"),
        Operator(8, f"o_proj + {reduce_kind}", n, n, "reduction at the layer end", "every layer"),
        Operator(9, "router (gate + grouped top-k)", moe, moe, "routing + dispatch in one kernel",
                 f"{moe} MoE layers"),
        Operator(10, "MoE dispatch (all-to-all)", moe if ep else 0, moe if ep else 0, "DeepEP low-latency / normal",
                 "only under EP" if ep else "no EP: experts are TP-split, no all-to-all"),
        Operator(11, "expert GEMMs (w1, w3, w2)", moe + dense, moe + dense, "grouped GEMM",
                 f"{moe} MoE + {dense} dense MLPs"),
        Operator(12, "MoE combine (all-to-all back)", moe if ep else 0, moe if ep else 0,
                 "overlaps the second GEMM", "only under EP" if ep else "no EP"),
        Operator(13, "LM head", 1, 1, "vocab-parallel GEMM",
                 "decode: every step, after the last layer; prefill: only the chunk that ends the prompt"),
        Operator(14, "sampling", 1, 1, "GPU kernel",
                 "prefill samples once, in the last chunk (the first output token); the note writes 'none'"),
        Operator(15, "MTP draft / verify", mtp, 0, "separate forward",
                 f"only with speculation on: one forward a draft, the verify is the main forward over 1 + "
                 f"{drafts(asm)} tokens a request" if mtp else "only with speculation on"),
    ]


def decode_launches(ops: list[Operator], asm: Assumptions) -> float:
    """Eager kernel launches of one decode step: every operator occurrence x kernels per operator (+1 for
    the embedding lookup)."""
    return (1 + sum(o.decode for o in ops)) * asm.kernels_per_op
