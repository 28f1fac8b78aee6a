"""Collectives of one forward: which calls, how many, how many bytes, and how long on NVLink and on IB.

Owns: the per-step collective plan for pure TP, DP-attention + EP and TP + EP (note 001's "一次 decode
step 的集合通信总账"), the PD handoff per request, and bytes -> time (per-rank ring bytes over the
per-direction link bandwidth plus a fixed per-call overhead; or the notes' message-bytes method).
Request-path stages it predicts: 5 (embedding all-reduce), 6 (per-layer reductions, MoE dispatch /
combine), 8 (vocab all-gather). Names of kinds match `collective_calls.<kind>` of common/counters.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.common.counters import ring_wire_factor
from dsaserve.config import ModelConfig
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.ledger.hardware import Hardware
from dsaserve.ledger.units import ceil_div

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
COUNT_BYTES = 8  # int64 pair count per (sender, receiver): dsaserve's DP-attention count exchange
ROUTE_META_BYTES = 8  # int32 expert id + fp32 routing weight packed after each dispatched row (dsaserve)


def wire_factor(kind: str, n: int) -> float:
    """Bytes a rank sends over its link per message byte: ring all-reduce 2(n-1)/n, all-gather /
    reduce-scatter (n-1)/n, all-to-all (n-1)/n (the message is every (token, expert) copy of the rank's
    tokens; with experts spread evenly 1/n of the copies stay on the rank)."""
    if kind == "all_to_all":
        return (n - 1) / n if n > 1 else 0.0
    return ring_wire_factor(kind, n)


def a2a_tokens(dep: Deployment, asm: Assumptions, tokens: int, one_request: bool = False) -> int:
    """Tokens whose (token, expert) copies one rank dispatches in a forward over `tokens` tokens.

    Under DP-attention a rank holds only its own requests: a decode batch spreads over the DP ranks
    (ceil(b/dp)), while one request's prefill chunk sits whole on one rank. Without DP-attention every rank
    holds all tokens after the o_proj all-reduce, and the EP group scatters them before dispatch (each rank
    sends ceil(T/ep): engine/expert_parallel.a2a_moe_forward, SGLang's DeepEP path). `a2a_count=deployment`
    counts all tokens, every sender summed: the notes' table.
    """
    if asm.a2a_count == "deployment":
        return tokens
    if dep.dp_attention:
        return tokens if one_request else ceil_div(tokens, dep.dp)
    return ceil_div(tokens, dep.ep)


@dataclass(frozen=True)
class CollectiveRow:
    point: str  # where in the forward
    kind: str
    calls: int
    message_bytes: float  # one call's message (the notes' 单次消息量)
    ranks: int
    why: str

    @property
    def total_message(self) -> float:
        return self.calls * self.message_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes one rank sends over all calls of this row."""
        return self.total_message * wire_factor(self.kind, self.ranks)


def link_time(row_bytes_message: float, row_bytes_wire: float, calls: int, hw: Hardware, asm: Assumptions,
              link: str) -> float:
    bw = hw.nvlink_bw if link == "nvlink" else hw.ib_bw
    overhead = hw.nvlink_overhead_s if link == "nvlink" else hw.ib_overhead_s
    moved = row_bytes_wire if asm.comm_basis == "wire" else row_bytes_message
    return moved / bw + calls * overhead


def row_time(row: CollectiveRow, hw: Hardware, asm: Assumptions, link: str = "nvlink") -> float:
    if row.ranks <= 1:
        return 0.0
    return link_time(row.total_message, row.wire_bytes, row.calls, hw, asm, link)


def forward_layers(cfg: ModelConfig, mtp: bool | str = False) -> tuple[int, int]:
    """(decoder layers, MoE layers) of one forward: the main model's, with the MTP layers' too (`mtp` True: a prefill
    chunk the MTP layer extends over), or the MTP layers' alone (`mtp` "only": a draft forward)."""
    main = (cfg.num_hidden_layers, len(cfg.moe_layers))
    extra = (len(cfg.mtp_layer_ids), sum(cfg.is_moe(i) for i in cfg.mtp_layer_ids))
    if mtp == "only":
        return extra
    return (main[0] + extra[0], main[1] + extra[1]) if mtp else main


def step_plan(cfg: ModelConfig, dep: Deployment, asm: Assumptions, tokens: int, logits_rows: int | None = None,
              mtp: bool | str = False, one_request: bool = False, rank_rows: int | None = None
              ) -> list[CollectiveRow]:
    """Collectives of one forward over `tokens` tokens of the whole deployment (decode: b; prefill: chunk).

    `logits_rows` = rows the lm_head computes (decode: b; prefill chunk: 1 per request, 0 mid-prompt).
    `mtp`: see `forward_layers` (a draft forward embeds its tokens and computes logits as the main model does).
    `one_request`: the tokens are one request's (a prefill chunk), so under DP-attention one rank holds them
    all. MoE dispatch / combine rows are one rank's: see `a2a_tokens`.
    DP-attention with `asm.dp_moe` "a2a" or "padded" is dsaserve's engine (`dp_a2a_plan`, `dp_padded_plan`;
    `rank_rows`: the rows every rank was padded to, default ceil(tokens / dp)); "gather" the notes' table.
    """
    if dep.dp_attention and asm.dp_moe == "a2a":
        return dp_a2a_plan(cfg, dep, asm, tokens, mtp)
    if dep.dp_attention and asm.dp_moe == "padded":
        rows = ceil_div(tokens, dep.dp) if rank_rows is None else rank_rows
        return dp_padded_plan(cfg, dep, asm, rows, mtp)
    h, n = cfg.hidden_size, dep.tp
    layers, n_moe = forward_layers(cfg, mtp)
    n_dense = layers - n_moe
    act = tokens * h * asm.act_bytes
    logits_rows = tokens if logits_rows is None else logits_rows
    rows: list[CollectiveRow] = []
    if not dep.dp_attention or asm.dp_embed_allreduce:
        rows.append(CollectiveRow("embedding (vocab-parallel)", "all_reduce", 1, act, n,
                                  f"each rank looks up {cfg.vocab_size // n:,} of {cfg.vocab_size:,} rows"))
    if dep.dp_attention:
        gathers = layers if asm.dp_gather == "per_layer" else 1
        rows.append(CollectiveRow("DP all-gather of hidden states", "all_gather", gathers, act, n,
                                  "attention is per request; the MLP side needs the global batch"))
        rows.append(CollectiveRow("attention output reduce-scatter", "reduce_scatter", layers, act, n,
                                  "back to each rank's own requests after every layer"))
    else:
        rows.append(CollectiveRow("attention output all-reduce (o_proj)", "all_reduce", layers, act, n,
                                  "o_proj is row-parallel over heads"))
    if n_dense:
        rows.append(CollectiveRow("dense-layer MLP all-reduce", "all_reduce", n_dense, act, n,
                                  f"first_k_dense_replace={n_dense}: row-parallel down_proj"))
    if dep.ep > 1:
        k, sent = cfg.num_experts_per_tok, a2a_tokens(dep, asm, tokens, one_request)
        whose = "all senders' tokens" if asm.a2a_count == "deployment" else "this rank's tokens"
        rows.append(CollectiveRow("MoE dispatch (FP8)", "all_to_all", n_moe,
                                  sent * k * h * asm.dispatch_bytes, dep.ep,
                                  f"{sent:,} tokens ({whose}) to their {k} experts' ranks"))
        rows.append(CollectiveRow("MoE combine (BF16)", "all_to_all", n_moe,
                                  sent * k * h * asm.combine_bytes, dep.ep,
                                  f"{k} expert outputs back per token, {sent:,} tokens ({whose})"))
    elif n_moe:
        rows.append(CollectiveRow("MoE output all-reduce", "all_reduce", n_moe, act, n,
                                  "experts TP-split: every rank holds 1/TP of each expert"))
    if logits_rows:
        rows.append(CollectiveRow("vocab all-gather of logits", "all_gather", 1,
                                  logits_rows * cfg.vocab_size * asm.logits_bytes, n,
                                  "each rank computes V/TP logits per row (FP32)"))
    return [r for r in rows if r.ranks > 1]


def dp_a2a_plan(cfg: ModelConfig, dep: Deployment, asm: Assumptions, tokens: int,
                mtp: bool | str = False) -> list[CollectiveRow]:
    """dsaserve's DP-attention (distributed/expert_parallel.py `dp_exchange`): attention, dense MLPs, shared
    experts, embedding and lm_head run replicated on each rank's own batch (no collective); every MoE layer
    exchanges pair counts, then dispatches rows (+ expert id and weight) and combines the weighted outputs.
    `tokens` = all ranks' tokens together; messages are sender totals summed over the ranks (each rank's own
    share depends on routing). Ranks with no tokens make the same calls (`forward_idle`)."""
    n, h, k = dep.ep, cfg.hidden_size, cfg.num_experts_per_tok
    n_moe = forward_layers(cfg, mtp)[1]
    pairs = tokens * k
    rows = [CollectiveRow("MoE count exchange", "all_to_all", n_moe, n * n * COUNT_BYTES, n,
                          "ranks route their own tokens: each tells every rank how many pairs follow"),
            CollectiveRow("MoE dispatch (+ expert id, weight)", "all_to_all", n_moe,
                          pairs * (h * asm.dispatch_bytes + ROUTE_META_BYTES), n,
                          f"every token to its {k} experts' ranks (sender total), {ROUTE_META_BYTES} B of routing "
                          "per row"),
            CollectiveRow("MoE combine", "all_to_all", n_moe, pairs * h * asm.combine_bytes, n,
                          f"{k} weighted expert outputs back per token")]
    return [r for r in rows if r.ranks > 1 and r.calls]


def dp_padded_plan(cfg: ModelConfig, dep: Deployment, asm: Assumptions, rank_rows: int,
                   mtp: bool | str = False) -> list[CollectiveRow]:
    """dsaserve's DP-attention gather steps (distributed/expert_parallel.py `dp_gather_forward`): every rank
    contributes the same `rank_rows` (engine/dp_step.py: at decode the graph bucket of the busiest rank's
    tokens, an idle rank's batch all padding; eager steps the busiest rank's count), and each MoE layer
    all-gathers the n x rank_rows hidden rows, runs the rank's experts on them and reduce-scatters the
    routed sums back to their ranks.
    Messages are one rank's (the gathered output, the full reduce-scatter input), the same on every rank.
    Against `dp_a2a_plan`: 2 calls instead of 3 and no host split sizes; per rank on the wire
    2 (n-1) x rank_rows x h x a instead of about 2 k (n-1)/n x tokens x h x a (k = top-k): fewer bytes
    whenever rank_rows < k/n x the rank's tokens, i.e. for GLM-5.3 at n = 2 unless a rank holds 4x another's."""
    n, h = dep.ep, cfg.hidden_size
    n_moe = forward_layers(cfg, mtp)[1]
    message = n * rank_rows * h * asm.act_bytes
    rows = [CollectiveRow("MoE all-gather of every DP rank's rows", "all_gather", n_moe, message, n,
                          f"{n} ranks x {rank_rows:,} padded rows: each rank runs its experts on every token"),
            CollectiveRow("MoE reduce-scatter of the routed sums", "reduce_scatter", n_moe, message, n,
                          "each rank's experts' partial sums back to the rows' own rank")]
    return [r for r in rows if r.ranks > 1 and r.calls]


def hidden_reduction_rows(rows: list[CollectiveRow]) -> list[CollectiveRow]:
    """The hidden-size reductions the notes sum (494 MB / 261 MB): no all-to-all, no logits gather."""
    return [r for r in rows if r.kind != "all_to_all" and not r.point.startswith("vocab")]


def note_topologies(tp: int, ep: int) -> dict[str, Deployment]:
    """The two decode topologies of note 001's table (pure TP, DP-attention + EP), at the asked sizes."""
    return {"tp": Deployment(tp=tp), "dp_ep": Deployment(tp=tp, ep=ep, dp_attention=True)}


def pd_transfer_bytes(kv_main_per_token: int, kv_indexer_per_token: int, context: int) -> int:
    """Main KV + indexer K of one request handed from prefill to decode (note 001: d x L x 78 + 21 x 132 x L)."""
    return (kv_main_per_token + kv_indexer_per_token) * context


def transfer_time(nbytes: float, bw: float, links: int, overhead: float = 0.0) -> float:
    """Bulk transfer spread over `links` per-GPU links in parallel (each GPU sends its share)."""
    return nbytes / (bw * max(links, 1)) + overhead
