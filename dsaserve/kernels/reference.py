"""Reference kernels: plain-PyTorch implementations of every hot op (stage 6 of the request path).

Owns: the *spec* of each op. They run on the CPU (the CI path and the HF-oracle tests) and are the
oracle the GPU variants (`kernels/triton_*.py`) are tested against; `kernels/registry.py` picks one
implementation per op once, at startup, by device. Same signature on both sides.

Conventions shared by all ops:
- FP8 weights are float8_e4m3fn [N, K] with `weight_scale_inv` float32 [ceil(N/128), ceil(K/128)]
  (DeepSeek/GLM block scaling): w[n, k] = q[n, k] * s[n // 128, k // 128].
- KV rows are the byte layouts of `common/kv_layout.py` (a KVLayout, which also holds the codec);
  slot = page * page_size + offset; -1 = no slot.
- RoPE is HF's: interleaved pairs (GLM main + indexer, DeepSeek main) produce [evens' | odds'] halves;
  non-interleaved (DeepSeek indexer) is rotate-half.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from dsaserve.common import index_pages
from dsaserve.common.kv_layout import KVLayout, decode_index_k, decode_latent, encode_index_k, encode_latent

FP8_BLOCK = 128


def dequant_fp8_weight(weight: torch.Tensor, scale_inv: torch.Tensor,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[.., N, K] FP8 + [.., ceil(N/128), ceil(K/128)] scales -> dense `dtype` weight."""
    n, k = weight.shape[-2:]
    s = scale_inv.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return (weight.to(torch.float32) * s).to(dtype)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T for a block-scaled FP8 W. x [M, K] -> [M, N] in x.dtype (fp32 accumulation)."""
    w = dequant_fp8_weight(weight, weight_scale_inv)
    return (x.float() @ w.t()).to(x.dtype)


def head_bmm(x: torch.Tensor, w: torch.Tensor, flatten: bool = False) -> torch.Tensor:
    """Per-head GEMM of absorbed MLA: x [T, H, K] @ w [H, K, N] -> [T, H, N] (or [T, H*N] with flatten)."""
    y = torch.bmm(x.transpose(0, 1), w).transpose(0, 1)
    return y.reshape(y.shape[0], -1) if flatten else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalise in fp32, cast back, then scale."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's step: s = x + residual; returns (rms_norm(s), s)."""
    s = x + residual
    return rms_norm(s, weight, eps), s


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a merged [gate | up] projection: x [.., 2I] -> silu(gate) * up [.., I]."""
    inter = x.shape[-1] // 2
    return F.silu(x[..., :inter]) * x[..., inter:]


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """`apply_rope` written back into x (a view: the rope slice of q or of the indexer's q / k)."""
    return x.copy_(apply_rope(x, cos, sin, interleaved))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [T, ..., R] by per-token angles; cos/sin are [T, R/2] (one angle per pair).

    Heads (if any) sit between T and R; cos/sin broadcast over them.
    """
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def mla_kv_write(kv_cache: torch.Tensor, layout: KVLayout, slots: torch.Tensor, kv_a: torch.Tensor,
                 norm_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 kv_lora_rank: int, q_rope: torch.Tensor | None = None) -> torch.Tensor:
    """Fused: RMSNorm(nope) + RoPE(rope, interleaved) + write to the paged cache.

    kv_a [T, kv_lora_rank + rope] is kv_a_proj_with_mqa's output; returns the latent [T, 576] written
    (before quantisation), which prefill may use directly. q_rope [T, H, rope] (q's RoPE slice, a view): rotated in
    place too (`rope_inplace`, interleaved), which the GPU kernel does in the same launch.
    """
    if q_rope is not None:
        rope_inplace(q_rope, cos, sin, True)
    nope = rms_norm(kv_a[:, :kv_lora_rank], norm_weight, eps)
    rope = apply_rope(kv_a[:, kv_lora_rank:], cos, sin, interleaved=True)
    latent = torch.cat([nope, rope], dim=-1)
    kv_cache.index_copy_(0, slots, encode_latent(latent, layout, kv_lora_rank))
    return latent


def indexer_k_write(index_cache: torch.Tensor, layout: KVLayout, slots: torch.Tensor, k: torch.Tensor) -> None:
    """Indexer-key write: k [T, D] (k_norm + RoPE applied) encoded at `slots` of the page-major cache."""
    index_pages.write_rows(index_cache, slots, encode_index_k(k, layout), layout, k.shape[-1])


def indexer_k_norm_write(index_cache: torch.Tensor, layout: KVLayout, slots: torch.Tensor, k_raw: torch.Tensor,
                         norm_weight: torch.Tensor, norm_bias: torch.Tensor, eps: float, cos: torch.Tensor,
                         sin: torch.Tensor, rope_dim: int, interleaved: bool, q: torch.Tensor | None = None) -> None:
    """Fused indexer-key path: k = LayerNorm(k_raw) (HF's k_norm), RoPE on its first rope_dim values, then
    `indexer_k_write`. q [T, heads, D] (the indexer's queries): the first rope_dim values of each head rotated in
    place too (`rope_inplace`), which the GPU kernel does in the same launch."""
    if q is not None:
        rope_inplace(q[..., :rope_dim], cos, sin, interleaved)
    k = F.layer_norm(k_raw, (k_raw.shape[-1],), norm_weight, norm_bias, eps)
    rope_inplace(k[..., :rope_dim], cos, sin, interleaved)
    indexer_k_write(index_cache, layout, slots, k)


def indexer_topk(q: torch.Tensor | None, head_weights: torch.Tensor | None, index_cache: torch.Tensor,
                 layout: KVLayout, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
                 topk: int, page_size: int, seq_lens: list[int], extend_lens: list[int]) -> torch.Tensor:
    """DSA lightning indexer: per query token, the top-k causal keys of its request, as physical slots.

    q [T, Hi, D] (RoPE applied), head_weights [T, Hi] (weights_proj output x Hi^-0.5 x D^-0.5, i.e. both
    HF scales folded: relu(s*x) = s*relu(x) for s > 0). Keys are positions 0..positions[t] of request
    req_index[t]; score_j = sum_h w[t,h] * relu(q[t,h] . k_j). Returns [T, topk] int64 slots, -1 padded
    when fewer than topk keys are visible. Tokens are request-major (ForwardBatch order).
    q and head_weights None: requests of at most topk keys (`StepContext.all_keys`), every key a token sees in
    position order, no scores.
    """
    out = torch.full((positions.shape[0], topk), -1, dtype=torch.int64, device=positions.device)
    start = 0
    for r, (n_kv, n_new) in enumerate(zip(seq_lens, extend_lens, strict=True)):
        if n_new == 0:
            continue
        pos = torch.arange(n_kv, device=positions.device)
        slots = page_table[r, pos // page_size] * page_size + pos % page_size
        unseen = pos[None, :] > positions[start:start + n_new, None]  # causal: keys past the token's position
        if q is None:
            if n_kv > topk:
                raise ValueError(f"indexer_topk: no queries, but request {r} has {n_kv} keys, past top-{topk}")
            out[start:start + n_new, :n_kv] = slots.expand(n_new, -1).masked_fill(unseen, -1)
            start += n_new
            continue
        keys = decode_index_k(index_pages.read_rows(index_cache, slots, layout, q.shape[-1]), layout).float()
        qs = q[start:start + n_new].float()  # [n_new, Hi, D]
        scores = torch.einsum("thd,kd->thk", qs, keys).relu()
        scores = torch.einsum("thk,th->tk", scores, head_weights[start:start + n_new].float())
        scores = scores.masked_fill(unseen, float("-inf"))
        k = min(topk, n_kv)
        vals, idx = scores.topk(k, dim=-1)
        out[start:start + n_new, :k] = slots[idx].masked_fill(vals == float("-inf"), -1)
        start += n_new
    return out


def sparse_mla_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, kv_cache: torch.Tensor, layout: KVLayout,
                         topk_slots: torch.Tensor, softmax_scale: float, kv_lora_rank: int,
                         out: torch.Tensor | None = None, defer_combine: bool = False,
                         full_rows: bool = False) -> torch.Tensor:
    """Weight-absorbed sparse MLA over the paged latent cache (written into `out` when given).

    full_rows (a speed hint, no numbers depend on it here): every token's top-k is all valid slots, so a GPU
    kernel may divide it statically (`triton_sparse_mla.FULL_ROW_CONFIG`).

    defer_combine (the caller's promise that `head_bmm` is the output's only reader): a GPU kernel that split the
    keys may leave its partials on `out` for `head_bmm` to merge (`triton_sparse_mla.attach_splits`); here, and
    wherever a kernel did not split, `out` holds the result.

    q_nope [T, H, kv_lora_rank] (already multiplied by W_uk), q_rope [T, H, rope], topk_slots [T, K]
    (-1 = skip). score = (q_nope . c + q_rope . k_rope) * scale over the selected slots, softmax, and the
    output is the attention-weighted latent [T, H, kv_lora_rank] (the caller applies W_uv and o_proj).
    """
    t, k = topk_slots.shape
    valid = topk_slots >= 0
    rows = kv_cache.index_select(0, topk_slots.clamp(min=0).reshape(-1))
    latent = decode_latent(rows, layout, kv_lora_rank).float().view(t, k, -1)  # [T, K, 576]
    c, k_rope = latent[..., :kv_lora_rank], latent[..., kv_lora_rank:]
    scores = (torch.einsum("thc,tkc->thk", q_nope.float(), c) + torch.einsum("thr,tkr->thk", q_rope.float(), k_rope))
    scores = (scores * softmax_scale).masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    res = torch.einsum("thk,tkc->thc", probs, c).to(q_nope.dtype)
    return res if out is None else out.copy_(res)


def stage_latent(kv_cache: torch.Tensor, layout: KVLayout, pages: torch.Tensor, page_size: int, kv_lora_rank: int,
                 out: torch.Tensor) -> torch.Tensor:
    """The rows of `pages` (in order) of one layer's latent cache, dequantised into `out` [pages * page_size, 576]
    as bf16 rows of the bf16 layout (the FP32 value rounded once; model/layers/prefill_staging.py)."""
    rows = (pages.long()[:, None] * page_size + torch.arange(page_size, device=pages.device)).reshape(-1)
    out[: rows.numel()] = decode_latent(kv_cache.index_select(0, rows), layout, kv_lora_rank).to(out.dtype)
    return out


def remap_slots(slots: torch.Tensor, page_map: torch.Tensor, page_size: int) -> torch.Tensor:
    """[T, K] physical slots -> rows of a staging (`stage_latent`): page_map[page] * page_size + offset; -1, and a
    slot whose page has no staged copy (page_map -1), stay -1."""
    s = slots.long()
    page = page_map[s.clamp(min=0) // page_size].long()
    return torch.where((s >= 0) & (page >= 0), page * page_size + s % page_size, -1).to(slots.dtype)


def resolve_placeholders(input_ids: torch.Tensor, future_token_ids: torch.Tensor) -> None:
    """In place: every input id -1-j becomes future_token_ids[j] (overlap scheduling's placeholder, engine/overlap.py);
    real ids (>= 0) stay. No host sync and no data-dependent shape (capturable)."""
    rows = (-1 - input_ids).clamp_(min=0)  # real ids read row 0 and are not taken
    torch.where(input_ids < 0, future_token_ids.index_select(0, rows), input_ids, out=input_ids)


def embed_rope_rows(ids: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, table: torch.Tensor,
                    future_token_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's first gathers: (the ids' embedding rows [T, H], the positions' RoPE table rows [T, R]: cos | sin,
    `model/layers/rope.RotaryTables`), with `future_token_ids` the ids' placeholders resolved in place first
    (`resolve_placeholders`). One GPU (the vocabulary unsplit): under TP the embedding masks and all-reduces
    (`model/layers/embedding.py`)."""
    if future_token_ids is not None:
        resolve_placeholders(ids, future_token_ids)
    return weight.index_select(0, ids), table.index_select(0, positions)


def copy_from_host(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (the device) <- src (pinned host memory, same dtype and size, both contiguous): a decode graph's inputs
    out of their staging buffer (engine/cuda_graph_runner.py), as an asynchronous copy (a graph's copy node)."""
    dst.copy_(src, non_blocking=True)


def stage_from_host(rows: torch.Tensor, rows_src: torch.Tensor, table: torch.Tensor, changes: torch.Tensor,
                    max_deltas: int) -> None:
    """A decode graph's inputs out of pinned host memory with the device's page table changed in place (engine/
    page_table_mirror.py): rows (the device) <- rows_src (pinned, same size), then `changes` (pinned: [count, count
    flat indices into `table` then padding to max_deltas, the count values then padding]) written: table[index] =
    value for each of the count pairs (at most max_deltas; an index outside `table`, 1-D on the device, is dropped).
    The count is read when this runs: a graph that captured this function would replay the capture's count (the
    runner's probe refuses it)."""
    if rows_src.numel() != rows.numel() or changes.numel() != 1 + 2 * max_deltas:
        raise ValueError(f"stage_from_host: {rows_src.numel()} rows for {rows.numel()}, {changes.numel()} change "
                         f"values for 1 + 2 x {max_deltas}")
    rows.copy_(rows_src, non_blocking=True)
    count = min(int(changes[0]), max_deltas)
    idx, values = changes[1:1 + count], changes[1 + max_deltas:1 + max_deltas + count]
    inside = (idx >= 0) & (idx < table.numel())  # as the kernel: an index outside the table is dropped
    table[idx[inside].to(table.device)] = values[inside].to(table.device)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """The greedy sampler's token of each row of logits x [rows, vocab]: int64 [rows], the first maximum (NaN above
    every number), torch's argmax."""
    return x.argmax(dim=-1)


def small_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear without bias over a dense weight (`Linear` not kept FP8: the indexer's bf16 weights_proj; the
    reference path's dequantised projections): x @ W^T in x.dtype."""
    return F.linear(x, weight)


def router_logits(x: torch.Tensor, weight_f32: torch.Tensor) -> torch.Tensor:
    """The MoE router's logits as HF computes them: fp32 x [T, H] @ weight [E, H]^T -> [T, E] fp32."""
    return F.linear(x.float(), weight_f32.float())


def moe_route(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
              routed_scaling_factor: float, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 / GLM routing: sigmoid scores; `bias` steers selection only; group-limited top-k.

    router_logits [T, E] fp32 -> (weights [T, k] fp32, expert ids [T, k] int64).
    """
    scores = router_logits.float().sigmoid()
    choice = scores + bias
    t, e = choice.shape
    group_scores = choice.view(t, n_group, e // n_group).topk(min(2, e // n_group), dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    choice = choice.masked_fill(score_mask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def count_distinct(ids: torch.Tensor, num_values: int, counter: torch.Tensor) -> None:
    """counter (int64 scalar on ids' device) += how many distinct values in [0, num_values) ids holds (an id
    of num_values — an absent expert's pair, `fused_moe` — is not counted); no host sync, so it replays
    inside CUDA graphs (the `moe_experts_touched` counter)."""
    hit = torch.zeros(num_values + 1, dtype=torch.int64, device=ids.device)
    counter += hit.index_fill_(0, ids.reshape(-1).clamp(0, num_values), 1)[:num_values].sum()


class SharedExpert(NamedTuple):
    """A shared expert for `fused_moe` to sum in: gate+up [2I, H] (gate rows then up rows) and down [H, I], FP8
    with 128x128 block scales, and `run`, the expert as its module runs it apart (x -> its output), for the
    sizes a kernel does not fuse it at (the GPU path's `DenseMLP.expert_form`)."""

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    run: Callable[[torch.Tensor], torch.Tensor]


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor | None, w2: torch.Tensor,
              w2_scale: torch.Tensor | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              add: torch.Tensor | None = None, absent: bool = False, shared: SharedExpert | None = None,
              side_stream: object = None) -> torch.Tensor:
    """Routed experts: sum_k w[t,k] * down_e(silu(gate_e(x)) * up_e(x)) with e = topk_ids[t,k] (+ add, e.g. the
    shared expert's output, after the sum is rounded to x.dtype). `side_stream`: the GPU op's (unused here).

    w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I]; FP8 with block scales, or dense when the
    scales are None (the CPU path dequantises once at load). `absent`: ids may be E — a pair whose expert
    another rank holds (`local_routes`) — which contributes nothing and costs nothing. `shared`: the shared
    expert's weights instead of its output: here its fp32 output rounded once is the `add`.
    """
    if shared is not None:
        if add is not None:
            raise ValueError("fused_moe: give the shared expert as `shared` or its output as `add`, not both")
        g = x.float() @ dequant_fp8_weight(shared.w13, shared.w13_scale).t()
        half = g.shape[-1] // 2
        add = ((F.silu(g[:, :half]) * g[:, half:]) @ dequant_fp8_weight(shared.w2, shared.w2_scale).t()).to(x.dtype)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    inter = w2.shape[2]
    for e in topk_ids.unique().tolist():
        if e >= w13.shape[0]:  # an absent expert's pairs
            continue
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        a = w13[e] if w13_scale is None else dequant_fp8_weight(w13[e], w13_scale[e])
        b = w2[e] if w2_scale is None else dequant_fp8_weight(w2[e], w2_scale[e])
        h = x[tok].float() @ a.float().t()
        h = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, (h @ b.float().t()) * topk_weights[tok, slot, None].float())
    return out.to(x.dtype) if add is None else out.to(x.dtype) + add
