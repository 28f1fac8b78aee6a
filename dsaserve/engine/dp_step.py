"""DP-attention step agreement (request path 3-4 across the attention ranks; docs/PARALLELISM.md).

Owns: how the DP ranks agree, every step, on how their MoE layers meet, and the padding that makes the
graph-safe way possible. Each rank schedules its own requests, so before a forward every rank tells the
others its token count and whether its batch is decode-only — one CPU all-gather of two integers over a
gloo group (SGLang's `prepare_mlp_sync_batch`; control plane, not counted with the model's collectives) —
and every rank derives the same `DPStep` from the same table:

  gather: every rank pads its batch to the same row count, the decode-graph bucket of the busiest rank's
    tokens (`pad_batch`: padding requests of one token at position 0, KV into the pool's sink page; an
    idle rank runs padding only). Each MoE layer all-gathers every rank's rows, runs this rank's experts on
    all of them and reduce-scatters the sums back (distributed/expert_parallel.py `dp_gather_forward`).
    Shapes are fixed per bucket, so the step replays a CUDA graph with the collectives inside it.
  a2a: each rank's own tokens exchanged by count all-to-all + dispatch + combine (`dp_exchange`), an idle
    rank through `forward_idle`; host split sizes, so eager.
  skip: no rank has a token (the leader stepped everybody, nobody could schedule): no forward at all.

The rule (`--dp-moe auto`): gather when every busy rank's batch is decode-only (one new token per request,
what the decode graphs hold) and the busiest holds at most `cuda_graph_max_bs` tokens; a2a otherwise. Why:
per MoE layer a rank puts 2(n-1) x rows x H x a bytes on the wire under gather against ~2k(n-1)/n x tokens
x H x a under a2a (k = top-k, 8 for GLM-5.3: gather moves fewer bytes unless the ranks are very unbalanced),
in 2 calls instead of 3 and without a host sync per call. But gather runs this rank's experts over all
n x rows tokens — the other ranks' experts' pairs at weight 0 on local expert 0 — which a prefill chunk of
thousands of tokens cannot afford, and past the largest bucket there is no graph to win.
`--dp-moe gather` / `a2a` force one way for every step (gather past the largest bucket pads to the busiest
rank's count and runs eager).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dsaserve.model.forward_batch import ForwardBatch

GATHER, A2A, SKIP = "gather", "a2a", "skip"


@dataclass(frozen=True)
class DPStep:
    mode: str  # GATHER, A2A or SKIP
    rows: int  # GATHER: the rows every rank's batch is padded to; else 0
    tokens: tuple[int, ...]  # every rank's own tokens this step, in rank order


def choose_dp_step(tokens: Sequence[int], decode: Sequence[bool], buckets: Sequence[int],
                   policy: str = "auto") -> DPStep:
    """The step every rank derives from the gathered table (module docstring: the rule). `decode[r]`: rank r's
    batch has one new token per request; `buckets`: the decode-graph batch sizes, ascending."""
    tokens = tuple(int(t) for t in tokens)
    busiest = max(tokens)
    if busiest == 0:
        return DPStep(SKIP, 0, tokens)
    fits = busiest <= buckets[-1]
    graphable = fits and all(d or t == 0 for t, d in zip(tokens, decode, strict=True))
    if policy == A2A or (policy == "auto" and not graphable):
        return DPStep(A2A, 0, tokens)
    return DPStep(GATHER, next(b for b in buckets if b >= busiest) if fits else busiest, tokens)


class DPStepSync:
    """One rank's side of the agreement: `agree(batch)` (None: nothing scheduled here) before every main
    forward, on every DP rank, in the same order — the contract `ModelRunner.forward` / `forward_idle` keep."""

    def __init__(self, group: object, world: int, buckets: Sequence[int], policy: str = "auto"):
        self.group, self.buckets, self.policy = group, list(buckets), policy
        self._mine = torch.zeros(2, dtype=torch.int64)
        self._table = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]

    def agree(self, batch: ForwardBatch | None) -> DPStep:
        if batch is None:
            self._mine[0], self._mine[1] = 0, 1
        else:
            self._mine[0], self._mine[1] = batch.num_tokens, all(n == 1 for n in batch.host_lens()[1])
        dist.all_gather(self._table, self._mine, group=self.group)
        table = torch.stack(self._table).tolist()
        return choose_dp_step([t for t, _ in table], [bool(d) for _, d in table], self.buckets, self.policy)


def empty_batch(page_size: int) -> ForwardBatch:
    """A batch of no requests (an idle rank's, before padding)."""
    none = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(none, none, none, none, none, torch.zeros(0, 1, dtype=torch.int64), none, none, page_size,
                        [], [])


def pad_batch(batch: ForwardBatch, rows: int, sink_page: int) -> ForwardBatch:
    """The host batch with padding requests appended up to `rows` tokens and `moe_gather` set: each padding
    request is one token (id 0) at position 0 whose KV goes to the sink page (what the graph runner's padding
    rows do); logits only for the real rows, and the counters skip the padding (`num_padding`)."""
    pad = rows - batch.num_tokens
    if pad < 0:
        raise ValueError(f"pad_batch: the batch has {batch.num_tokens} tokens, more than the agreed {rows}")
    if sink_page < 0:
        raise ValueError("pad_batch: the KV pool has no sink page for padding rows")
    b, width, dev = batch.batch_size, batch.page_table.shape[1], batch.input_ids.device
    seq_lens, extend_lens = batch.host_lens()

    def more(x: torch.Tensor, value: int, shape: tuple[int, ...] = (pad,)) -> torch.Tensor:
        return torch.cat([x, torch.full(shape, value, dtype=torch.int64, device=dev)])

    return replace(batch, input_ids=more(batch.input_ids, 0), positions=more(batch.positions, 0),
                   req_index=torch.cat([batch.req_index, torch.arange(b, b + pad, device=dev)]),
                   seq_lens=more(batch.seq_lens, 1), extend_lens=more(batch.extend_lens, 1),
                   page_table=more(batch.page_table, sink_page, (pad, width)),
                   out_cache_loc=more(batch.out_cache_loc, sink_page * batch.page_size),
                   seq_lens_cpu=list(seq_lens) + [1] * pad, extend_lens_cpu=list(extend_lens) + [1] * pad,
                   moe_gather=True, num_padding=batch.num_padding + pad)
