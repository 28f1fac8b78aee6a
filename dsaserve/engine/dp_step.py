"""DP-attention step agreement (request path 3-4 across the attention ranks; docs/PARALLELISM.md).

Owns: how the DP ranks agree, every step, on how their MoE layers meet. Each rank schedules its own
requests, so before a forward every rank tells the others its token count and whether its batch is
decode-only — one CPU all-gather of two integers over a gloo group (SGLang's `prepare_mlp_sync_batch`;
control plane, not counted with the model's collectives) — and every rank derives the same `DPStep`:

  gather: the MoE layers all-gather `rows` rows from every rank, run this rank's experts on all of them
    and reduce-scatter the sums back (distributed/expert_parallel.py `dp_gather_forward`). `graph` steps
    (decode-only, within the captured buckets): `rows` is the bucket of the busiest rank's tokens, every
    rank replays that bucket's CUDA graph — its batch padded to it, an idle rank's all padding — with the
    collectives inside. Other gather steps run eager: each rank's own tokens through attention, the MoE
    padding them to `rows` = the busiest rank's count (padding rows route to no expert); an idle rank runs
    only the MoE layers, on padding.
  a2a: each rank's own tokens exchanged by count all-to-all + dispatch + combine (`dp_exchange`), an idle
    rank through `forward_idle`; host split sizes, so eager.
  skip: no rank has a token (the leader stepped everybody, nobody could schedule): no forward at all.

The rule (`--dp-moe auto`): a graph gather step when every busy rank is decode-only and the busiest holds at
most `cuda_graph_max_bs` tokens; else an eager gather step while the gathered rows (ranks x busiest) fit what
the memory profile sized (`max_gather_rows` = ranks x max(chunked_prefill_size, max_num_batched_tokens): the
profile runs its largest prefill as a gather step of every rank, `as_gather_step` — so every step the
scheduler forms gathers); else a2a (a forward larger than the scheduler's budget, e.g. a benchmark's).
Why gather first: per MoE layer the busiest rank puts 2(n-1) x rows x H x a
bytes on the wire against 2k(n-1)/n x rows x H x a for its dispatch + combine (k = top-k, 8 for GLM-5.3:
gather is never more while n <= k), in 2 calls instead of 3 and with no host sync; the experts compute only
their own pairs either way (other ranks' pairs, and an eager step's padding rows, are absent experts, which
the kernels skip).
What gather costs is memory: every rank's experts see n x rows tokens' pairs, n times a rank's own — so a
step past what the profile measured goes a2a. `--dp-moe gather` / `a2a` force one way for every step.
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
    rows: int  # GATHER: the rows each rank contributes to the MoE gathers; else 0
    tokens: tuple[int, ...]  # every rank's own tokens this step, in rank order
    graph: bool = False  # GATHER at a captured bucket: every rank replays (or pads its batch to) `rows`


def choose_dp_step(tokens: Sequence[int], decode: Sequence[bool], buckets: Sequence[int], max_gather_rows: int,
                   policy: str = "auto") -> DPStep:
    """The step every rank derives from the gathered table (module docstring: the rule). `decode[r]`: rank r's
    batch has one new token per request; `buckets`: the decode-graph batch sizes, ascending."""
    tokens = tuple(int(t) for t in tokens)
    busiest = max(tokens)
    if busiest == 0:
        return DPStep(SKIP, 0, tokens)
    if policy == A2A:
        return DPStep(A2A, 0, tokens)
    if busiest <= buckets[-1] and all(d or t == 0 for t, d in zip(tokens, decode, strict=True)):
        return DPStep(GATHER, next(b for b in buckets if b >= busiest), tokens, graph=True)
    if policy == GATHER or len(tokens) * busiest <= max_gather_rows:
        return DPStep(GATHER, busiest, tokens)
    return DPStep(A2A, 0, tokens)


class DPStepSync:
    """One rank's side of the agreement: `agree(batch)` (None: nothing scheduled here) before every forward whose
    MoE layers meet the other ranks' — the main forward and, with speculative decoding, each MTP forward — on every
    DP rank, in the same order: the contract `ModelRunner.forward` / `forward_with_hidden` / `forward_idle` /
    `forward_mtp` keep. One CPU all-gather each (with k drafts, k + 1 a step)."""

    def __init__(self, group: object, world: int, buckets: Sequence[int], max_gather_rows: int,
                 policy: str = "auto"):
        self.group, self.buckets, self.max_gather_rows, self.policy = group, list(buckets), max_gather_rows, policy
        self._mine = torch.zeros(2, dtype=torch.int64)
        self._table = [torch.zeros(2, dtype=torch.int64) for _ in range(world)]

    def agree(self, batch: ForwardBatch | None, graph: bool = True) -> DPStep:
        """`graph=False`: this rank runs its batch eagerly whatever it holds (a forward that must keep its hidden
        rows, an MTP forward), so it reports no decode-only batch and no rank's step replays a graph."""
        if batch is None:
            self._mine[0], self._mine[1] = 0, 1
        else:
            self._mine[0], self._mine[1] = batch.num_tokens, graph and all(n == 1 for n in batch.host_lens()[1])
        dist.all_gather(self._table, self._mine, group=self.group)
        table = torch.stack(self._table).tolist()
        return choose_dp_step([t for t, _ in table], [bool(d) for _, d in table], self.buckets,
                              self.max_gather_rows, self.policy)


def as_gather_step(batch: ForwardBatch, dp_world: int) -> ForwardBatch:
    """The batch as a gather step of `dp_world` ranks that each hold as many tokens: how the memory profile and
    the prefill warmup run under DP-attention, so they size (and compile for) the largest step the rule lets
    gather — every rank's experts over dp_world x its tokens. One rank (dp_world 1): the batch as it is."""
    if dp_world <= 1:
        return batch
    return replace(batch, dp_rows=batch.num_tokens, dp_tokens=(batch.num_tokens,) * dp_world)


def empty_batch(page_size: int) -> ForwardBatch:
    """A batch of no requests: what an idle rank hands the graph runner, which replays it as padding only."""
    none = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(none, none, none, none, none, torch.zeros(0, 1, dtype=torch.int64), none, none, page_size,
                        [], [])
