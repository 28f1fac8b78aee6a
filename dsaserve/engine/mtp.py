"""Speculative decoding with the checkpoint's MTP layer (request path stage 7: "MTP draft and verify").

Owns: the drafts — one token a request, the MTP layer's greedy guess at the token after the last one — their
verification in the next decode step, and the MTP layer's KV. `--speculative-algorithm mtp` (SGLang's NEXTN with
one step, vLLM's `deepseek_mtp` with one speculative token).

A step with drafts (`EngineCore.step`, synchronous):
  1. verify: each decode row with a draft d computes its last token t and d together (the scheduler reserves two
     slots; engine/batch.py writes [t, d] and asks logits at both), so the forward gives the distribution of the
     token after t (row r0) and, as if d followed, of the token after d (row r1).
  2. sample: r0 is sampled as any step samples its row, and r1 as a row whose output already holds d (`DraftRow`:
     penalties and min_tokens see d). The token a0 drawn from r0 is the step's first token whatever d was, so the
     output distribution is exactly the model's; d is kept when a0 == d, and then r1's draw a1 is valid too: two
     tokens in one step. With a one-hot draft this is speculative sampling's rule (d kept with probability p(d), else
     a draw from p without d), and for greedy rows the argmax test.
  3. the MTP layer's extend (`MTPDrafter.extend`): at position i the layer reads the main model's final hidden h_i
     and the embedding of token i+1, writes its own KV at i and predicts token i+2. It runs over every position a
     request computed this step whose next token is known now (a prompt chunk's, the kept tokens' — never a draft
     that was not kept), and the argmax at the request's last one is its next draft.
Drafts are proposals: a wrong or stale one (a prefix-cache page whose MTP KV another request wrote, a request
preempted and recomputed) costs acceptance, never a different output. Not drafted: structured-output requests
(their grammar would have to take d before r1's mask), and a request with room for one more token only. A step
without drafts runs the same way (its hidden rows feed the MTP layer's extend). Counters: `spec_draft_tokens`,
`spec_accepted_tokens` (the engine's stats and Prometheus). TP / EP ranks run the same steps and sample alike
(engine/rank_group.py), so they draft alike.

Left for later: more than one draft a step (the MTP layer chained on its own hidden rows, SGLang's
`--speculative-num-steps`); overlap scheduling (the drafts are read on the host before the next step is
scheduled); DP-attention (a rank's MTP steps would need the others' idle partners, `forward_idle(mtp_layer)`);
CUDA graphs for the verify step (it replays the piecewise graphs, not the decode graphs) and for the MTP layer's
extend (eager).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dsaserve.engine.request import Req, ReqStatus
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.model.forward_batch import ForwardBatch
from dsaserve.model.sampler import SamplerOutput


class DraftRow:
    """The draft's logits row (r1) as the sampler sees it: the request with its draft as one more output token.
    Its seeded generator is the request's own, so a seed draws r0 and then r1 from one stream."""

    grammar = None

    def __init__(self, req: Req, draft: int):
        self.req, self.draft = req, draft

    @property
    def sampling(self) -> Any:
        return self.req.sampling

    @property
    def generator(self) -> Any:
        return self.req.generator

    @generator.setter
    def generator(self, g: Any) -> None:
        self.req.generator = g

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.req.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return [*self.req.output_token_ids, self.draft]

    @property
    def suppressed_token_ids(self) -> tuple[int, ...]:
        return tuple(self.req.stop_ids) if self.req.num_output + 1 < self.req.sampling.min_tokens else ()


class MTPDrafter:
    """Drafts for one engine core's requests, from its runner's MTP layer (`forward_mtp`)."""

    def __init__(self, runner: Any):
        model = getattr(runner, "model", None)
        if not getattr(model, "with_mtp", False) or not hasattr(runner, "forward_mtp"):
            raise ValueError("--speculative-algorithm: this model has no MTP layer to draft with "
                             "(num_nextn_predict_layers = 0, or a runner without forward_mtp)")
        self.runner = runner
        self.draft_tokens = 0
        self.accepted_tokens = 0

    @staticmethod
    def drafts_for(req: Req) -> bool:
        """Whether req takes drafts: no grammar, and room for the two tokens a verify step may give it."""
        return req.grammar is None and len(req.tokens) + 2 <= req.max_len

    def sample_rows(self, sched: ScheduledBatch, samples: list[Req], rows: list[int]
                    ) -> tuple[list[Any], list[int]]:
        """The sampler's rows: the step's samples, then each draft's row r1 (`DraftRow`)."""
        extra = [(DraftRow(req, req.draft), r1) for req, r1 in sched.draft_rows if req.status is ReqStatus.RUNNING]
        return [*samples, *(d for d, _ in extra)], [*rows, *(r for _, r in extra)]

    def kept(self, samples: list[Any], out: SamplerOutput) -> dict[Req, tuple[int, dict | None]]:
        """Each request whose draft equals the token its row r0 drew -> (r1's token, its logprobs); counts."""
        first = {r: i for i, r in enumerate(samples) if isinstance(r, Req)}
        kept = {}
        for j in range(len(first), len(samples)):
            row: DraftRow = samples[j]
            self.draft_tokens += 1
            if out.token_ids[first[row.req]] == row.draft:
                self.accepted_tokens += 1
                kept[row.req] = (out.token_ids[j], out.logprobs[j])
        return kept

    def extend(self, sched: ScheduledBatch, batch: ForwardBatch, hidden: torch.Tensor, starts: list[int],
               kept: dict[Req, tuple[int, dict | None]]) -> None:
        """The MTP layer over the positions each request computed this step whose next token is known (its KV),
        and the next drafts from the last position of each request that sampled (its argmax there)."""
        plan = self._plan(sched, batch, starts, kept)
        for req in sched.reqs:
            req.draft = None
        if plan is None:
            return
        mtp_batch, keep, drafting = plan
        logits = self.runner.forward_mtp(mtp_batch, hidden.index_select(0, keep.to(hidden.device)))
        for req, tok in zip(drafting, logits.argmax(dim=-1).tolist(), strict=True):
            req.draft = tok

    def _plan(self, sched: ScheduledBatch, batch: ForwardBatch, starts: list[int],
              kept: dict[Req, tuple[int, dict | None]]) -> tuple[ForwardBatch, torch.Tensor, list[Req]] | None:
        """(the MTP layer's host batch, the step's hidden rows it reads, the requests drafting from it) or None."""
        sampling, verified = set(sched.logit_reqs), {req for req, _ in sched.draft_rows}
        out_loc = batch.out_cache_loc
        ids, pos, req_index, loc, seq_lens, ext, rows, keep, logit_idx, drafting = ([] for _ in range(10))
        t = 0  # the step's first token of this request
        for r, (req, n, start) in enumerate(zip(sched.reqs, sched.num_new, starts, strict=True)):
            valid = n - (req in verified and req not in kept)  # a draft not kept: its hidden row is another token's
            if req.status is ReqStatus.RUNNING and req.grammar is None and valid > 0:
                k = len(rows)
                ids += req.tokens[start + 1:start + valid + 1]
                pos += range(start, start + valid)
                req_index += [k] * valid
                loc += out_loc[t:t + valid].tolist()
                keep += range(t, t + valid)
                seq_lens.append(start + valid)
                ext.append(valid)
                rows.append(r)
                if req in sampling and self.drafts_for(req):
                    logit_idx.append(len(ids) - 1)
                    drafting.append(req)
            t += n
        if not rows:
            return None
        table = batch.page_table if batch.page_table_cpu is None else batch.page_table_cpu
        width = -(-max(seq_lens) // batch.page_size)
        mtp = ForwardBatch(_i64(ids), _i64(pos), _i64(req_index), _i64(seq_lens), _i64(ext),
                           table[rows, :width].cpu(), _i64(loc), _i64(logit_idx), batch.page_size, seq_lens, ext)
        return mtp, _i64(keep), drafting

    def stats(self) -> dict[str, int]:
        return {"spec_draft_tokens": self.draft_tokens, "spec_accepted_tokens": self.accepted_tokens}


def _i64(values: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))
