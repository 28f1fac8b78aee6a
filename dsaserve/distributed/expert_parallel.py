"""Expert parallelism for the routed experts of MoE layers (stage 6, "MoE").

Owns the two ways a rank's experts meet the tokens; routing itself is replicated (every rank computes the
same top-k from the same hidden states, so every rank also knows every other rank's send and receive
counts without exchanging them):

  simple EP (default): every rank runs its own experts on all tokens — pairs routed elsewhere get weight 0
    on local expert 0 — and the MoE layer's one all-reduce (the same call TP needs anyway) sums the parts.
    One collective per MoE layer, message T x H; the cost is each rank touching every token.
  all-to-all dispatch / combine (`moe_a2a=True`, ep = world; the DP-attention + EP row of note 001 that the
    ledger models for large deployments): each rank takes a contiguous 1/n of the tokens, sends each
    (token, expert) pair's hidden row to the expert's rank (dispatch), the expert rank returns the
    weighted output rows (combine), the rank sums its tokens' k rows, adds the shared expert (under TP its
    partial sums are reduce-scattered onto the same token chunks), and an all-gather restores the full
    batch for the next (replicated or TP) attention. Per MoE layer: 2 all_to_all (+1 reduce_scatter under
    TP) + 1 all_gather. Needs host split sizes, so it runs eager (no CUDA graph).

Also: turning global expert ids into this rank's local ones, and slicing experts whose intermediate part is
not 128-aligned after dequantising them (see distributed/sharding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.distributed.collectives import all_gather, all_to_all, reduce_scatter
from dsaserve.distributed.sharding import ExpertPlacement, Shard
from dsaserve.kernels.reference import dequant_fp8_weight


def local_routes(weights: torch.Tensor, ids: torch.Tensor,
                 p: ExpertPlacement) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weights, ids) over global experts -> over this rank's experts: pairs routed to other ranks become
    (weight 0, local expert 0). Returns the mask of pairs that are really local (None: all experts here)."""
    if p.count == p.total:
        return weights, ids, None
    local = (ids >= p.first) & (ids < p.first + p.count)
    return weights.masked_fill(~local, 0.0), torch.where(local, ids - p.first, 0), local


def finalize_deferred_experts(experts: nn.Module, dtype: torch.dtype, keep_fp8: bool) -> None:
    """Dequantise the whole-intermediate FP8 experts this rank held through loading, then keep its part."""
    if keep_fp8:
        raise ValueError(experts.fp8_misaligned)
    p = experts.placement
    rows, cols = p.inter_shard, Shard(1, p.inter_shard.rank, p.inter_shard.parts)
    w13 = dequant_fp8_weight(experts.w13.data, experts.w13_scale.data, dtype)
    w13 = torch.cat([rows.take(w13[:, : p.inter]), rows.take(w13[:, p.inter:])], dim=1)
    w2 = cols.take(dequant_fp8_weight(experts.w2.data, experts.w2_scale.data, dtype))
    experts.w13 = nn.Parameter(w13.contiguous(), requires_grad=False)
    experts.w2 = nn.Parameter(w2.contiguous(), requires_grad=False)
    experts.w13_scale = experts.w2_scale = None
    experts.keep_fp8 = False


def _split_counts(x: torch.Tensor, parts: int) -> list[int]:
    return torch.bincount(x, minlength=parts).tolist()


def a2a_moe_forward(moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ctx) -> torch.Tensor:
    """The MoE layer's output [T, H] (routed + shared) via all-to-all dispatch / combine over moe.group."""
    g, p = moe.group, moe.experts.placement
    t, k = ids.shape
    chunk = -(-t // g.size)  # tokens per rank; the last ranks may get fewer (or none)
    lo, hi = min(g.rank * chunk, t), min((g.rank + 1) * chunk, t)
    dest = torch.div(ids, p.count, rounding_mode="floor")  # EP rank of every (token, slot); ep = world here

    # dispatch: my chunk's pairs, ordered by destination rank (stable: token-major within a destination)
    mine = dest[lo:hi].reshape(-1)
    order = torch.argsort(mine, stable=True)
    send_tok = torch.div(order, k, rounding_mode="floor") + lo
    send_counts = _split_counts(mine, g.size)
    # what arrives: every rank's pairs addressed to me, in rank order, token-major — known from routing alone
    recv_tok, recv_slot = (dest == g.rank).nonzero(as_tuple=True)
    recv_counts = _split_counts(torch.div(recv_tok, chunk, rounding_mode="floor"), g.size)
    received = all_to_all(x[send_tok], recv_counts, send_counts, g)

    if received.shape[0]:
        y = moe.experts(received, weights[recv_tok, recv_slot][:, None], ids[recv_tok, recv_slot][:, None], ctx)
    else:
        y = received
    back = all_to_all(y, send_counts, recv_counts, g)  # combine: my pairs' weighted outputs, in send order

    out = torch.zeros(chunk, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, send_tok - lo, back.float())
    out = out.to(x.dtype)
    if moe.shared_experts is not None:
        if moe.shared_split:  # TP-split shared expert: partial sums over all tokens, reduced onto the chunks
            padded = torch.nn.functional.pad(x, (0, 0, 0, chunk * g.size - t))
            out = out + reduce_scatter(moe.shared_experts(padded), g)
        else:
            out[: hi - lo] += moe.shared_experts(x[lo:hi])
    return all_gather(out, g)[:t]
