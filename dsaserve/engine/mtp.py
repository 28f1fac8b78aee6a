"""Speculative decoding with the checkpoint's MTP layer (request path stage 7: "MTP draft and verify").

Owns: the drafts — up to `--speculative-num-steps` tokens a request, the MTP layer's greedy guesses at the tokens
after the last one — their verification in the next decode step, and the MTP layer's KV. `--speculative-algorithm
mtp` (SGLang's NEXTN with one top-1 chain, vLLM's `deepseek_mtp`).

A step with drafts (`EngineCore.step`; it waits for its samples, not for its drafts):
  1. verify: each decode row with drafts d1..dk computes its last token t and them together (the scheduler
     reserves k + 1 slots; engine/batch.py writes [t, d1..dk] and asks logits at each), so the forward gives the
     distribution of the token after t (row r0) and, as if d1..dj followed, of the token after dj (row rj).
  2. sample: r0 is sampled as any step samples its row, and rj as a row whose output already holds d1..dj
     (`DraftRow`: penalties and min_tokens see them; one seeded stream, r0 first). The token a0 drawn from r0 is the
     step's first token whatever the drafts were; d1 is kept when a0 == d1, and then a1 (drawn from r1) is valid
     too, d2 is kept when a1 == d2, and so on: 1 + kept tokens in one step. Every token comes from the model's own
     distribution, so the outputs are plain decoding's; with one-hot drafts this is speculative sampling's rule (dj
     kept with probability p(dj), else a draw from p without it), and for greedy rows the argmax test.
  3. the MTP layer's extend (`MTPDrafter.extend`): at position i the layer reads the main model's final hidden h_i
     and the embedding of token i+1, writes its own KV at i and predicts token i+2. It runs over every position a
     request computed this step whose next token is known now (a prompt chunk's, the kept tokens' — never a draft
     that was not kept), and its argmax at the request's last one is d1. Drafts 2..k chain the layer on its own
     output (`_chain`): at the next position, the embedding of the draft before and the layer's output in place of
     the main model's hidden row, as SGLang's NextN steps do; their KV there is rewritten from real inputs when the
     position is computed. Each forward reads the drafts before it on the device, and the step ends without
     waiting for any: the drafts stay on the device (the runner's `future_token_ids`), the next step's verify rows
     carry them as placeholder ids resolved there, so the host schedules, builds and launches that step while the
     MTP forwards run, and takes the drafts' values (`materialize`: for the sampler's rows and the kept test) once
     it is launched (on the slice, H100: drafting's time against plain decoding 1.96x -> 1.68x at one request
     and one draft, 2.56x -> 2.39x at 16 requests x 3, bench/RESULTS.md, thirty-sixth session).
Drafts are proposals: a wrong or stale one (a prefix-cache page whose MTP KV another request wrote, a request
preempted and recomputed) costs acceptance, never a different output. Structured-output requests draft too: a
draft's row is masked by the grammar as if the drafts before it were taken (`grammar.DraftGrammar`), and the kept
draws are taken in order after the step. No more drafts than the request's max_tokens leaves room for, the budget
and `--mixed-step-tokens` take, and the free pages hold (drafts never preempt). A step without drafts runs the same
way (its hidden rows feed the MTP layer's extend). Counters (the scheduler's, in the engine's stats and
Prometheus): `spec_draft_tokens` verified, `spec_accepted_tokens` kept and emitted. TP / EP ranks run the same
steps and sample alike (engine/rank_group.py), so they draft alike.

Under DP-attention each rank drafts for its own requests; the MTP layer's MoE meets the other ranks', so every rank
runs `--speculative-num-steps` MTP forwards every step (the ranks agree on each as on a main forward, an idle rank
or one whose requests stopped drafting takes part with no rows), and the verify and MTP forwards run eagerly.

On a GPU a verify step whose every token samples replays the decode CUDA graphs as one token a row
(`forward_batch.as_decode_rows`: each token over its request's page table up to its own position; the default
`--cuda-graph-max-bs` holds every running request's 1 + k rows); a step with a prompt chunk replays the piecewise
graphs. The MTP forwards replay graphs of their own, one token a row too (engine/mtp_graphs.py; an extend over more
rows than the largest bucket, a long prompt's, runs eagerly). Left for later: full overlap scheduling (within a
step the host still waits for the verify's samples before it prepares the MTP forwards); CUDA graphs for
DP-attention's verify and MTP forwards (eager).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from typing import Any

import numpy as np
import torch

from dsaserve.common.host_lists import HostCopy, to_device
from dsaserve.engine.grammar import DraftGrammar
from dsaserve.engine.request import Req, ReqStatus
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.kernels.registry import get_ops
from dsaserve.kernels.variants import core_width
from dsaserve.model.forward_batch import ForwardBatch
from dsaserve.model.sampler import SamplerOutput


class DraftRow:
    """A draft's logits row as the sampler sees it: the request with its drafts up to this one as more output tokens
    (its grammar too: `DraftGrammar`). Its seeded generator is the request's own, so a seed draws r0, r1, ... from
    one stream, in order."""

    def __init__(self, req: Req, drafts: list[int]):
        self.req, self.drafts = req, drafts

    @property
    def grammar(self) -> DraftGrammar | None:
        return None if self.req.grammar is None else DraftGrammar(self.req.grammar, self.drafts)

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
        return [*self.req.output_token_ids, *self.drafts]

    @property
    def suppressed_token_ids(self) -> tuple[int, ...]:
        return tuple(self.req.stop_ids) if self.req.num_output + len(self.drafts) < self.req.sampling.min_tokens else ()


@dataclass
class _Rows:
    """One MTP forward's rows, request by request: positions, the token after each, the hidden row it reads."""

    reqs: list[Req] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    logits: list[bool] = field(default_factory=list)  # whether the request's last row gives a draft

    def add(self, req: Req, start: int, tokens: list[int], draft: bool) -> None:
        self.reqs.append(req)
        self.starts.append(start)
        self.tokens.append(tokens)
        self.logits.append(draft)

    def batch(self, page_size: int, max_pages: int) -> ForwardBatch:
        """The host batch over each request's own pages (chained drafts write past what the step's table holds),
        at most `max_pages` wide (a request's most: the widest graphs' width)."""
        ids, pos, req_index, loc, logit_idx = [], [], [], [], []
        seq_lens = [s + len(t) for s, t in zip(self.starts, self.tokens, strict=True)]
        # the widths warm_mtp ran (not a kernel variant a width)
        width = min(core_width(-(-max(seq_lens) // page_size)), max_pages)
        table = np.zeros((len(self.reqs), width), dtype=np.int64)
        for k, (req, start, toks, draft) in enumerate(zip(self.reqs, self.starts, self.tokens, self.logits,
                                                          strict=True)):
            pages = req.pages[:-(-seq_lens[k] // page_size)]
            table[k, :len(pages)] = pages
            ids += toks
            pos += range(start, start + len(toks))
            req_index += [k] * len(toks)
            loc += [pages[p // page_size] * page_size + p % page_size for p in range(start, start + len(toks))]
            if draft:
                logit_idx.append(len(ids) - 1)
        ext = [len(t) for t in self.tokens]
        return ForwardBatch(_i64(ids), _i64(pos), _i64(req_index), _i64(seq_lens), _i64(ext), torch.from_numpy(table),
                            _i64(loc), _i64(logit_idx), page_size, seq_lens, ext,
                            table_rows=np.array([r.row for r in self.reqs], dtype=np.int64),
                            table_gens=np.array([r.row_gen for r in self.reqs], dtype=np.int64))


class MTPDrafter:
    """Drafts for one engine core's requests, from its runner's MTP layer (`forward_mtp`): up to `steps` a request,
    the layer chained on its own output past the first."""

    def __init__(self, runner: Any, scheduler: Any, steps: int = 1):
        model = getattr(runner, "model", None)
        if not getattr(model, "with_mtp", False) or not hasattr(runner, "forward_mtp"):
            raise ValueError("--speculative-algorithm: this model has no MTP layer to draft with "
                             "(num_nextn_predict_layers = 0, or a runner without forward_mtp)")
        self.runner, self.scheduler, self.steps = runner, scheduler, steps
        self.page_size, self.max_pages = scheduler.cfg.page_size, scheduler.max_pages_per_seq
        # the drafts' values on the device, which the next verify step's placeholder ids read (`extend`): a runner
        # with this buffer resolves every negative input id against it in each forward (ModelRunner: the eager,
        # piecewise and decode-graph paths); without it the host waits for the drafts at the end of each step
        self.future: torch.Tensor | None = getattr(runner, "future_token_ids", None)
        self._pending: tuple[list[Req], HostCopy] | None = None  # drafts placed, their values on the way
        # DP-attention: the ranks' MTP forwards meet in the MoE layer, so every rank runs `steps` of them every step,
        # a rank without rows for one as an idle partner (ModelRunner.forward_mtp with no batch)
        self.lockstep = getattr(runner, "dp_sync", None) is not None

    def idle(self, forwards: int | None = None) -> None:
        """DP-attention: this rank's share of the others' MTP forwards (all of a step's, by default) with no rows."""
        if self.lockstep:
            for _ in range(self.steps if forwards is None else forwards):
                self.runner.forward_mtp(None, None)

    def drafts_for(self, req: Req) -> int:
        """How many drafts req takes: up to `steps`, as many as the tokens a verify step
        may give it leave room for (the last token, then one more per draft)."""
        return max(0, min(self.steps, req.max_len - len(req.tokens) - 1))

    def sample_rows(self, sched: ScheduledBatch, samples: list[Req], rows: list[int]
                    ) -> tuple[list[Any], list[int]]:
        """The sampler's rows: the step's samples, then each draft's row (`DraftRow`), a request's in order."""
        extra = [(DraftRow(req, req.drafts[:j + 1]), first + j) for req, n, first in sched.draft_rows
                 if req.status is ReqStatus.RUNNING for j in range(n)]
        return [*samples, *(d for d, _ in extra)], [*rows, *(r for _, r in extra)]

    @staticmethod
    def kept(samples: list[Any], out: SamplerOutput) -> dict[Req, list[tuple[int, dict | None]]]:
        """Each request's kept drafts -> the tokens drawn after each (token, logprobs): draft j is kept when the row
        before it drew it and every draft before it was kept (the scheduler counts the drafts and takes the kept
        tokens, its grammar each in turn: none past one that ends the request)."""
        first = {r: i for i, r in enumerate(samples) if isinstance(r, Req)}
        rows: dict[Req, list[int]] = {}
        for j in range(len(first), len(samples)):
            rows.setdefault(samples[j].req, []).append(j)
        kept: dict[Req, list[tuple[int, dict | None]]] = {}
        for req, js in rows.items():
            drawn = out.token_ids[first[req]]
            after = kept[req] = []
            for j in js:
                if drawn != samples[j].drafts[-1]:
                    break
                drawn = out.token_ids[j]
                after.append((drawn, out.logprobs[j]))
        return kept

    def extend(self, sched: ScheduledBatch, batch: ForwardBatch, hidden: torch.Tensor, starts: list[int],
               kept: dict[Req, list[tuple[int, dict | None]]]) -> None:
        """The MTP layer over the positions each request computed this step whose next token is known (its KV),
        its argmax at the last position of each request that sampled (the first draft), then chained on its own
        output for the others."""
        self.materialize()
        for req in sched.reqs:
            req.drafts = []
        rows, keep = self._extend_rows(sched, starts, kept)
        if not rows.reqs:
            self.idle()
            return
        logits, h = self.runner.forward_mtp(rows.batch(self.page_size, self.max_pages),
                                            hidden.index_select(0, to_device(keep, torch.int64, hidden.device)))
        drafting = list(compress(rows.reqs, rows.logits))
        draws = [(drafting, _argmax(logits))]
        self._chain(draws, h)
        tokens = torch.cat([t for _, t in draws])
        on_device = self.future is not None and tokens.numel() <= self.future.numel()
        if on_device:
            # the drafts stay on the device: the next step's verify rows read them as placeholders (-1-g: the g-th
            # draft), so the host schedules and launches it while the MTP forwards run; `materialize` brings their
            # values (for the sampler's rows and the kept test) once that step is launched
            self.future[:tokens.numel()].copy_(tokens, non_blocking=True)
            self._pending = ([req for reqs, _ in draws for req in reqs], HostCopy([tokens]))
        ids = iter(range(-1, -1 - tokens.numel(), -1) if on_device else tokens.tolist())  # else: a wait for them
        for reqs, _ in draws:
            for req in reqs:
                req.drafts.append(next(ids))

    def materialize(self) -> None:
        """The last extend's drafts as values on the host, in place of their placeholders: a wait for the MTP
        forwards that made them (queued before the step launched since, which the device runs meanwhile). A
        request whose drafts were dropped since (preempted, aborted, finished) has none to replace."""
        if self._pending is None:
            return
        (reqs, copy), self._pending = self._pending, None
        values = copy.lists()[0]
        for req in dict.fromkeys(reqs):
            req.drafts = [values[-1 - d] if d < 0 else d for d in req.drafts]

    def _extend_rows(self, sched: ScheduledBatch, starts: list[int], kept: dict[Req, list]
                     ) -> tuple[_Rows, list[int]]:
        """Per request of the step: the positions whose hidden row is its own token's (a draft not kept: another
        token's) and whose next token is known, and the step's hidden rows they read."""
        sampling, verified = set(sched.logit_reqs), {req: n for req, n, _ in sched.draft_rows}
        rows, keep, t = _Rows(), [], 0  # t: the step's first token of this request
        for req, n, start in zip(sched.reqs, sched.num_new, starts, strict=True):
            valid = n - (verified.get(req, 0) - len(kept.get(req, ())))
            if req.status is ReqStatus.RUNNING and valid > 0:
                rows.add(req, start, req.tokens[start + 1:start + valid + 1],
                         req in sampling and self.drafts_for(req) > 0)
                keep += range(t, t + valid)
            t += n
        return rows, keep

    def _chain(self, draws: list[tuple[list[Req], torch.Tensor]], h: torch.Tensor) -> None:
        """Drafts 2.. of each request: the MTP layer at the position after its last draft's, on the embedding of that
        draft and its own output there (SGLang's chained NextN steps). Their KV is rewritten from real inputs when
        those positions are computed; a request whose pool is short of a page for them stops drafting there. Each
        forward reads the drafts before it on the device (`draws`: the requests and their tokens, appended to), so
        the host waits for none of them: which requests chain depends only on what the host knows."""
        for j in range(2, self.steps + 1):
            reqs, prev = draws[-1]
            rows, pick = _Rows(), []
            for k, req in enumerate(reqs):
                pos = len(req.tokens) + j - 3  # the last token's position is len - 1; draft j - 1 guessed len + j - 2
                if self.drafts_for(req) >= j and self.scheduler.grow_pages(req, pos + 1):
                    # the token: draft j - 1, on the device (a placeholder: row len(pick) of the picked drafts)
                    rows.add(req, pos, [-1 - len(pick)], True)
                    pick.append(k)
            if not rows.reqs:
                self.idle(self.steps - j + 1)
                return
            if len(pick) < len(reqs):
                picked = to_device(pick, torch.int64, h.device)
                h, prev = h.index_select(0, picked), prev.index_select(0, picked)
            logits, h = self.runner.forward_mtp(rows.batch(self.page_size, self.max_pages), h, prev)
            draws.append((rows.reqs, _argmax(logits)))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """The greedy draft of each row, on the device (the sampler's argmax op)."""
    return get_ops(logits.device).row_argmax(logits)


def _i64(values: list[int]) -> torch.Tensor:
    return torch.from_numpy(np.array(values, dtype=np.int64))
