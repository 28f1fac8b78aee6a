"""Prompt logprobs (vLLM's `prompt_logprobs`; the completions API's echo with logprobs, which lm-eval-harness's
loglikelihood tasks send): each prompt token's logprob given the tokens before it, its rank and the top-k
alternatives, from the raw model distribution, as the sampler's logprobs (model/sampler.py).

Owns: which of a step's tokens give a prompt entry — every computed prompt position but the last, whose logits
sample the first output token (the sampler's row) — their projection through the LM head in blocks of rows, and
handing each request its entries when the step resolves. A block bounds the step's extra memory: a 2K-token
chunk's logits at once would be 2K x 155K x 4 B = 1.3 GB at GLM-5.3's vocabulary; 256 rows are 160 MB (x ~3 at
the peak: the logits, their float32 copy and log-softmax, under TP the LM head's vocabulary gather: `block_bytes`,
which the memory profile takes as a floor of a step's peak activations).

Invariants: a request asks for each position once (`Req.prompt_lp_asked` moves at build time, before the step
that computes it resolves: the overlap scheduler builds the next step first); the prefix cache never serves a
position still unasked (`Req.cacheable_tokens`), so every position is computed by some launched step; every
rank of a TP group runs the same loop (the LM head all-gathers the vocabulary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dsaserve.common.host_lists import HostCopy

BLOCK_ROWS = 256
# a block's bytes per (row, vocabulary entry) at its peak: bf16 logits (2), their float32 copy (4), the
# log-softmax (4), and under TP the float32 shard beside the gathered rows (4)
BLOCK_BYTES_PER_LOGIT = 14


def block_bytes(vocab_size: int) -> int:
    """The most one block of prompt-logprob rows allocates after the forward (the memory profile's floor)."""
    return BLOCK_ROWS * vocab_size * BLOCK_BYTES_PER_LOGIT


@dataclass
class PromptRows:
    """A step's prompt-logprob rows: flat token indices of the batch, the prompt token each predicts, which
    request each run of rows belongs to, and the most alternatives any of them asked for."""

    rows: list[int]
    targets: list[int]
    spans: list[tuple[object, int]]  # (Req, rows), in row order
    k: int

    def ask(self, batch) -> None:
        """Put the rows on the step's ForwardBatch (host tensors: they travel with it to the device)."""
        batch.prompt_rows = torch.tensor(self.rows, dtype=torch.int64)
        batch.prompt_targets = torch.tensor(self.targets, dtype=torch.int64)
        batch.prompt_k = self.k


def prompt_rows(reqs: Sequence, num_new: Sequence[int]) -> PromptRows | None:
    """The rows of a scheduled step (its requests and new-token counts, before `launched` moves them on);
    marks their positions asked. None when no request of the step wants any."""
    rows: list[int] = []
    targets: list[int] = []
    spans: list[tuple[object, int]] = []
    k, t = 0, 0
    for req, n in zip(reqs, num_new, strict=True):
        if req.prompt_logprobs is not None and req.prompt_lp_asked < req.prompt_len - 1:
            nc = req.num_computed
            first, end = max(nc, req.prompt_lp_asked), min(nc + n, req.prompt_len - 1)
            if end > first:
                rows += range(t + first - nc, t + end - nc)
                targets += req.tokens[first + 1:end + 1]
                spans.append((req, end - first))
                k = max(k, req.sampling.prompt_logprobs)
                req.prompt_lp_asked = end
        t += n
    return PromptRows(rows, targets, spans, k) if rows else None


@torch.inference_mode()
def compute(model, hidden: torch.Tensor, rows: torch.Tensor, targets: torch.Tensor, k: int
            ) -> tuple[torch.Tensor, ...]:
    """(logprob [P], rank [P], top values [P, k], top ids [P, k]) on the device for hidden's `rows`, whose
    next tokens are `targets`; rank 1 is the most likely token (ties share the better rank)."""
    rows = rows.to(hidden.device, non_blocking=True)
    targets = targets.to(hidden.device, non_blocking=True)
    parts = []
    for s in range(0, rows.numel(), BLOCK_ROWS):
        lp = torch.log_softmax(model.compute_logits(hidden.index_select(0, rows[s:s + BLOCK_ROWS])).float(), dim=-1)
        chosen = lp.gather(1, targets[s:s + BLOCK_ROWS, None])
        rank = (lp > chosen).sum(dim=1) + 1
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        parts.append((chosen[:, 0], rank, top_v, top_i))
        del lp  # before the next block's logits: one block's [rows, vocab] at a time (plus the LM head's gather)
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


class PromptLogprobsFuture:
    """A step's prompt entries on their way to the host (queued at once, behind an event, as the sampler's)."""

    def __init__(self, plan: PromptRows, device_out: tuple[torch.Tensor, ...]):
        self.plan, self._copy = plan, HostCopy(device_out)

    def attach(self) -> None:
        """Append each request's entries, in position order, to `Req.prompt_logprobs`."""
        chosen, rank, top_v, top_i = self._copy.lists()
        j = 0
        for req, count in self.plan.spans:
            n = req.sampling.prompt_logprobs
            for i in range(j, j + count):
                req.prompt_logprobs.append({"logprob": chosen[i], "rank": rank[i],
                                            "top": [[t, v] for t, v in zip(top_i[i][:n], top_v[i][:n], strict=True)]})
            j += count
