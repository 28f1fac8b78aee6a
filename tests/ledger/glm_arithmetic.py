"""GLM-5.3's byte and FLOP arithmetic written out by hand from the notes' model constants.

The note tests compare the ledger (which sums weights/spec.py's inventory through its own grouping) with
these independent products, so a grouping or sharding slip in the ledger shows up as a failing figure.
"""

from __future__ import annotations

from math import ceil

G = 2**20  # "1M tokens"
H, V, L, FULL, MOE, DENSE = 6144, 154_880, 78, 21, 75, 3
HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM = 64, 2048, 512, 192, 64, 256
IDX_HEADS, IDX_DIM, TOPK = 32, 128, 2048
E, K, MOE_I, DENSE_I = 256, 8, 2048, 12288


def fp8(n: int, k: int) -> int:
    """An FP8 weight plus its FP32 128x128 block scales."""
    return n * k + ceil(n / 128) * ceil(k / 128) * 4


EXPERT = 2 * fp8(MOE_I, H) + fp8(H, MOE_I)  # 37,757,952
ATTN_A = fp8(Q_LORA, H) + Q_LORA * 2 + fp8(KV_LORA + ROPE, H) + KV_LORA * 2  # + their BF16 norms
ATTN_B = fp8(HEADS * (NOPE + ROPE), Q_LORA) + fp8(HEADS * (NOPE + V_DIM), KV_LORA) + fp8(H, HEADS * V_DIM)
NORMS = 2 * H * 2  # input / post-attention RMSNorm
INDEXER = fp8(IDX_HEADS * IDX_DIM, Q_LORA) + fp8(IDX_DIM, H) + 2 * IDX_DIM * 2 + IDX_HEADS * H * 2
ROUTER = E * H * 2 + E * 4
SHARED = 2 * fp8(MOE_I, H) + fp8(H, MOE_I)
DENSE_MLP = 2 * fp8(DENSE_I, H) + fp8(H, DENSE_I)
FINAL_NORM, EMBED, LM_HEAD = H * 2, V * H * 2, V * H * 2
EXPERTS_MAIN = MOE * E * EXPERT

# one GPU under TP8 (pure TP: attention by heads, experts and dense MLPs 1/8, A-projections replicated)
W_TP8 = (EXPERTS_MAIN / 8 + L * ATTN_B / 8 + L * (ATTN_A + NORMS) + FULL * INDEXER + MOE * ROUTER
         + DENSE * DENSE_MLP / 8 + MOE * SHARED / 8 + FINAL_NORM + EMBED / 8 + LM_HEAD / 8)
# DP-attention + EP8 with dense / shared MLPs replicated (the note's "18 GB replicated part")
REPLICATED = (L * (ATTN_A + ATTN_B + NORMS) + FULL * INDEXER + MOE * ROUTER + DENSE * DENSE_MLP + MOE * SHARED
              + FINAL_NORM)
W_DP_READ = EXPERTS_MAIN / 8 + REPLICATED + LM_HEAD / 8  # the embedding is a gather, not a read

# the MTP layer: a full MoE decoder layer with its own indexer, plus eh_proj and three norms
MTP = ATTN_A + ATTN_B + NORMS + INDEXER + ROUTER + E * EXPERT + SHARED + fp8(H, 2 * H) + 3 * H * 2
CHECKPOINT = (EMBED + LM_HEAD + FINAL_NORM + L * (ATTN_A + ATTN_B + NORMS) + FULL * INDEXER + DENSE * DENSE_MLP
              + MOE * (ROUTER + SHARED) + EXPERTS_MAIN + MTP)

# parameters (no scales)
P_ATTN = H * Q_LORA + Q_LORA * HEADS * (NOPE + ROPE) + H * (KV_LORA + ROPE) + KV_LORA * HEADS * (NOPE + V_DIM) \
    + HEADS * V_DIM * H
P_INDEXER = Q_LORA * IDX_HEADS * IDX_DIM + H * IDX_DIM + H * IDX_HEADS
P_EXPERT = 3 * H * MOE_I
GEMM_PARAMS = L * P_ATTN + FULL * P_INDEXER + DENSE * 3 * H * DENSE_I + MOE * ((K + 1) * P_EXPERT + E * H)
ACTIVE = GEMM_PARAMS + V * H
P_MAIN = (2 * V * H + H + L * (P_ATTN + Q_LORA + KV_LORA + 2 * H) + FULL * (P_INDEXER + 2 * IDX_DIM)
          + DENSE * 3 * H * DENSE_I + MOE * (E * P_EXPERT + E * H + E + P_EXPERT))


def keys(n: int, prefix: int = 0) -> int:
    """Causal (query, key) pairs of n queries after a prefix."""
    return n * prefix + n * (n + 1) // 2


def topk_slots(n: int) -> int:
    """Sum over positions p < n of min(2048, p + 1)."""
    m = min(n, TOPK)
    return m * (m + 1) // 2 + (n - m) * TOPK


ATTN_FLOP_PER_SLOT = 2 * HEADS * (KV_LORA + ROPE + KV_LORA) * L
PREFILL_GEMM_CHUNK = 2 * GEMM_PARAMS * 32768 + ATTN_FLOP_PER_SLOT * topk_slots(32768)
PREFILL_GEMM_TOTAL = 2 * GEMM_PARAMS * G + 2 * V * H + ATTN_FLOP_PER_SLOT * topk_slots(G)
INDEXER_FLOPS = 2 * IDX_HEADS * IDX_DIM * FULL * keys(G)
INDEXER_READ_Q32 = keys(G) * 132 * FULL / 32
