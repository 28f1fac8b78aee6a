"""Expert parallelism for the routed experts of MoE layers (stage 6, "MoE").

Owns the four ways a rank's experts meet the tokens. In the first two, routing is replicated (every rank
computes the same top-k from the same hidden states, so every rank also knows every other rank's send and
receive counts without exchanging them); in the last two (DP-attention), each rank holds its own tokens:

  simple EP (default): every rank runs its own experts on all tokens — pairs routed elsewhere are skipped
    (`local_routes`: an absent expert's id) — and the MoE layer's one all-reduce (the same call TP needs
    anyway) sums the parts.
    One collective per MoE layer, message T x H; the cost is each rank touching every token.
  all-to-all dispatch / combine (`moe_a2a=True`, ep = world; the DP-attention + EP row of note 001 that the
    ledger models for large deployments): each rank takes a contiguous 1/n of the tokens, sends each
    (token, expert) pair's hidden row to the expert's rank (dispatch), the expert rank returns the
    weighted output rows (combine), the rank sums its tokens' k rows, adds the shared expert (under TP its
    partial sums are reduce-scattered onto the same token chunks), and an all-gather restores the full
    batch for the next (replicated or TP) attention. Per MoE layer: 2 all_to_all (+1 reduce_scatter under
    TP) + 1 all_gather. Needs host split sizes, so it runs eager (no CUDA graph).
  DP-attention exchange (`dp_exchange`, ep = world): every rank routes its *own* tokens (counts differ per
    rank, zero included), so nobody knows what arrives: an all_to_all of per-destination pair counts goes
    first, then dispatch (each pair's row with its expert id and routing weight packed on as 8 bytes, one
    call) and combine (the weighted output rows back). Per MoE layer: 3 all_to_all, nothing else. A rank
    with no tokens still makes all three calls (`idle_exchange`), so the collectives never hang.
  DP-attention gather (`dp_gather_forward`, SGLang's DP-attention MoE without DeepEP): every rank
    contributes the same row count P (engine/dp_step.py agrees on it each step: a replayed graph's padded
    batch, or the rank's own tokens padded here), so each MoE layer all-gathers the n x P hidden rows,
    routes them (row-wise: the top-k each rank would pick for its own), runs this rank's experts on all of
    them — pairs of other ranks' experts, and padding rows, are absent experts the kernels skip — and
    reduce-scatters the routed sums back to the rows' own rank; the shared expert stays local. Per MoE layer
    1 all_gather + 1 reduce_scatter of n x P x H, shapes fixed by P: they replay inside the decode graphs.

Also: turning global expert ids into this rank's local ones, and slicing experts whose intermediate part is
not 128-aligned after dequantising them (see distributed/sharding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.distributed.collectives import all_gather, all_to_all, reduce_scatter
from dsaserve.distributed.parallel_state import Group
from dsaserve.distributed.sharding import ExpertPlacement, Shard
from dsaserve.kernels.reference import dequant_fp8_weight


def local_routes(weights: torch.Tensor, ids: torch.Tensor,
                 p: ExpertPlacement) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(weights, ids) over global experts -> over this rank's experts: pairs routed to other ranks (or to no
    expert: id -1) become (weight 0, id p.count), an absent expert the MoE kernels skip
    (`fused_moe(absent=True)`). Returns the mask of pairs that are really local (None: all experts here)."""
    if p.count == p.total:
        return weights, ids, None
    local = (ids >= p.first) & (ids < p.first + p.count)
    return weights.masked_fill(~local, 0.0), torch.where(local, ids - p.first, p.count), local


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


def _chunk_bounds(t: int, rank: int, size: int) -> tuple[int, int, int]:
    """(tokens per rank, lo, hi) of the replicated-routing a2a: the last ranks may get fewer or none; a chunk
    is never 0 rows (a 0 would divide below, and a 0-token batch still makes every collective)."""
    chunk = max(1, -(-t // size))
    return chunk, min(rank * chunk, t), min((rank + 1) * chunk, t)


def a2a_moe_forward(moe: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, ctx) -> torch.Tensor:
    """The MoE layer's output [T, H] (routed + shared) via all-to-all dispatch / combine over moe.group."""
    g, p = moe.group, moe.experts.placement
    t, k = ids.shape
    chunk, lo, hi = _chunk_bounds(t, g.rank, g.size)
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
        elif hi > lo:  # an empty chunk (t < ranks) must not reach the GEMMs: 0-row launches are not safe
            out[: hi - lo] += moe.shared_experts(x[lo:hi])
    return all_gather(out, g)[:t]


# ---- DP-attention: every rank routes its own tokens -------------------------------------------------------
_META = 8  # bytes packed after each dispatched row: int32 global expert id + fp32 routing weight


def _pack(rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[N, H] rows + their (expert id, weight) as one uint8 [N, H * elem + 8] tensor: one all_to_all."""
    return torch.cat([rows.contiguous().view(torch.uint8), ids.to(torch.int32)[:, None].view(torch.uint8),
                      weights.float()[:, None].view(torch.uint8)], dim=1)


def _unpack(buf: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    body = buf.shape[1] - _META
    rows = buf[:, :body].contiguous().view(dtype)
    ids = buf[:, body:body + 4].contiguous().view(torch.int32)[:, 0].long()
    return rows, ids, buf[:, body + 4:].contiguous().view(torch.float32)[:, 0]


def _exchange_counts(send: torch.Tensor, g: Group) -> tuple[list[int], list[int]]:
    """all_to_all of per-destination pair counts: (what I send to each rank, what each rank sends me), read
    back to the host in one copy (the split sizes the row exchange needs)."""
    recv = all_to_all(send, [1] * g.size, [1] * g.size, g)
    sent, got = torch.stack([send, recv]).tolist()
    return sent, got


def dp_exchange(experts: nn.Module, group: Group, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                ctx: object) -> torch.Tensor:
    """Routed sum [T, H] of this rank's own tokens (T may be 0) via count exchange + dispatch + combine."""
    g, p = group, experts.placement
    t, k = ids.shape
    dest = torch.div(ids.reshape(-1), p.count, rounding_mode="floor")  # EP rank of every pair (ep = world)
    order = torch.argsort(dest, stable=True)  # pairs grouped by destination, token-major within one
    send_tok, send_slot = torch.div(order, k, rounding_mode="floor"), order % k
    send_counts, recv_counts = _exchange_counts(torch.bincount(dest, minlength=g.size), g)
    packed = _pack(x[send_tok], ids[send_tok, send_slot], weights[send_tok, send_slot])
    rows, r_ids, r_w = _unpack(all_to_all(packed, recv_counts, send_counts, g), x.dtype)
    # 0 rows received: skip the expert GEMMs (a 0-row launch is not safe on every GPU kernel)
    y = experts(rows, r_w[:, None], r_ids[:, None], ctx) if rows.shape[0] else rows
    back = all_to_all(y, send_counts, recv_counts, g)  # combine: my pairs' weighted outputs, in send order
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, send_tok, back.float()).to(x.dtype)


def dp_gather_forward(moe: nn.Module, x: torch.Tensor, rows: int, tokens: tuple[int, ...],
                      ctx: object) -> torch.Tensor:
    """The MoE layer's output [T, H] (routed + shared) for this rank's T <= rows rows: padded to `rows`,
    all-gathered, this rank's experts over every rank's rows, reduce-scattered. `tokens` (eager steps):
    every rank's own count, whose padding rows then route to no expert; () when every row is computed (a
    graph's padded batch)."""
    t = x.shape[0]
    mine = torch.nn.functional.pad(x, (0, 0, 0, rows - t)) if rows > t else x
    every = all_gather(mine, moe.group)  # [n * rows, H], rank-major: rank r's rows at [r * rows, (r + 1) * rows)
    weights, ids = moe.gate(every, ctx)
    if any(n < rows for n in tokens):
        real = torch.arange(rows, device=x.device)[None, :] < torch.tensor(tokens, device=x.device)[:, None]
        ids = ids.masked_fill(~real.reshape(-1, 1), -1)  # -1: no rank's expert (`local_routes`)
    routed = reduce_scatter(moe.experts(every, weights, ids, ctx), moe.group)[:t]  # sums over the experts' ranks
    if moe.shared_experts is None or t == 0:  # an idle rank: no 0-row GEMM launch
        return routed
    return routed + moe.shared_experts(x)


def idle_exchange(experts: nn.Module, group: Group, hidden: int, dtype: torch.dtype, device: torch.device,
                  ctx: object) -> None:
    """A rank with no tokens this step: the same three all_to_all calls with nothing of its own to send."""
    k = 1  # any k: zero pairs
    dp_exchange(experts, group, torch.empty(0, hidden, dtype=dtype, device=device),
                torch.empty(0, k, dtype=torch.float32, device=device),
                torch.empty(0, k, dtype=torch.int64, device=device), ctx)
