"""Scheduler: which requests compute how many tokens this step, and where their KV goes (stage 3 and 10).

Owns: the waiting and running queues, the per-step token budget, chunked prefill, page reservation
(through the prefix cache over the page allocator), preemption, `n` > 1 forks, finish checks (stop token
ids, EOS, max_tokens, context), abort, and `max_req_input_len`. Pure bookkeeping: no torch.

One step (note 001, stage 3: "选请求、分配 token 预算与 KV 页、前缀匹配"):
  1. running requests that decode (1 pending token), oldest first, then running requests in the middle
     of a prompt, oldest first: each gets min(pending, chunked_prefill_size, budget left) tokens, and the
     pages those tokens need. When pages run out the newest running request is preempted — its pages
     released, its tokens kept, recomputed later (its full pages usually come back from the prefix
     cache) — until the older request fits. So decodes keep going while a long prompt is prefilled in
     chunks (mixed steps), and the oldest request always progresses: no deadlock, never a crash.
  2. if nothing was preempted: waiting requests, first come first served, while budget, rows and pages
     last. Admission matches the prompt against the prefix cache first; only the suffix is computed.
  A step with decode rows caps the prefill tokens of both (`mixed_step_tokens`): one long prefill would
  otherwise stretch every running request's inter-token latency (issue 16: p99 ITL 7x the median TPOT
  at 32 x 1K on the H200 with a 2048-token step, 2.25x with the 576-token cap).
An `n` > 1 request never waits for n free rows at once (that stalled the whole queue behind it): its
leader is admitted when one row is free and reserves rows for as many followers as are free then; when
its prompt is in KV the followers that have a row fork from it, and the rest join the front of the
waiting queue as ordinary requests (their prompt's full pages come back from the prefix cache).
After the forward, `launched` counts the step's tokens as in KV (prefix-cache registration, forks) and gives
each sample a placeholder token; `resolve` puts the sampled tokens in and runs the finish checks. They run
back to back, or one step apart under overlap scheduling (engine/overlap.py): then a sample may be scheduled,
or preempted, while its last token is still on the device, and `live_samples` leaves out those that ended.
Pages are allocated per step as tokens need them (vLLM v1), not reserved for the whole request (SGLang's
PrefillAdder); a request always fits alone: its length is capped at `max_seq_len = min(max_model_len, pool
tokens)`, and `max_req_input_len = max_seq_len - 1` leaves room for one output token.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from dataclasses import dataclass, field

from dsaserve.common.request_limits import RequestLimits
from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.page_allocator import PageAllocator
from dsaserve.engine.page_table_rows import PageTableRows
from dsaserve.engine.prefix_cache import PrefixCache
from dsaserve.engine.prompt_entry_cache import PromptEntryCache
from dsaserve.engine.request import Req, ReqStatus, TokenDelta, placeholder
from dsaserve.engine.scheduler_audit import check_no_leak, count_drafts, count_kept, scheduler_stats, spec_counters


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int
    page_size: int
    max_num_batched_tokens: int
    chunked_prefill_size: int
    max_running_requests: int
    max_model_len: int
    mixed_step_tokens: int = 0  # a step with decode rows: tokens in all (prefill >= a quarter); 0 = no cap
    enable_prefix_caching: bool = True
    vocab_size: int = 0  # 0: token ids are not range-checked
    eos_token_ids: tuple[int, ...] = ()


@dataclass
class ScheduledBatch:
    """A step's decisions: batch rows in order, and which of them produce logits and samples."""

    reqs: list[Req]
    num_new: list[int]  # tokens each row computes this step
    logit_reqs: list[Req]  # rows whose last new token produces logits (they finish their pending tokens)
    sample_reqs: list[Req]  # the sampler's rows: logit_reqs plus n>1 followers forked this step
    sample_logit_rows: list[int]  # logits row each sample_req reads
    num_tokens: int
    # speculative decoding (engine/mtp.py): per row computing drafts after its last token, (the request, its drafts,
    # the logits row of the first draft: the token after it; the others follow); its own sample reads the row before
    draft_rows: list[tuple[Req, int, int]] = field(default_factory=list)


@dataclass
class _Step:
    budget: int
    sched: dict[Req, int] = field(default_factory=dict)
    preempted: bool = False
    draft_cap: int | None = None  # the step's tokens up to which decodes take their drafts (made on first use)
    decoders: int = 0  # the running requests that decode this step, drafts or not


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        ps = cfg.page_size
        self.max_seq_len = min(cfg.max_model_len, cfg.num_pages * ps)
        if self.max_seq_len < 2:
            raise ValueError(f"num_pages: a pool of {cfg.num_pages} pages with max_model_len {cfg.max_model_len}"
                             " cannot hold a prompt and one output token")
        self.max_req_input_len = self.max_seq_len - 1
        self.limits = RequestLimits(cfg.vocab_size, self.max_req_input_len, self.max_seq_len,
                                    cfg.max_running_requests)  # the HTTP door measures with the same ruler
        self.max_pages_per_seq = -(-self.max_seq_len // ps)
        self.alloc = PageAllocator(cfg.num_pages)
        self.cache = PrefixCache(self.alloc, ps, cfg.enable_prefix_caching)
        self.prompt_entries = PromptEntryCache(self.cache)
        self.prompt_lp_groups = 0  # unfinished requests asking prompt logprobs: a step looks for their rows only then
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # sorted by priority (oldest first)
        self.groups: dict[str, list[Req]] = {}  # request_id -> its n samples
        self.rows = PageTableRows(cfg.max_running_requests)
        self._abort_deltas: list[TokenDelta] = []
        self._seq = itertools.count()
        self.counters = dict(preemptions=0, prompt_tokens=0, generation_tokens=0, computed_tokens=0,
                             prefix_cache_hit_tokens=0, steps=0, requests=0, aborted=0, aborted_samples=0,
                             overlap_discarded_tokens=0, **spec_counters())

    # ---- admission -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                    arrival_time: float) -> None:
        self._validate(request_id, prompt, sampling)
        n = sampling.n
        # validated above: prompt + max_tokens <= max_seq_len, so max_len is the only length check needed
        max_len = self.max_seq_len if sampling.max_tokens is None else len(prompt) + sampling.max_tokens
        stop_ids = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos
                                                         else frozenset(self.cfg.eos_token_ids))
        prompt = list(prompt)
        reqs = [Req(request_id, i, prompt, sampling.for_sample(i) if n > 1 else sampling, arrival_time,
                    next(self._seq), max_len, stop_ids) for i in range(n)]
        leader = reqs[0]
        for f in reqs[1:]:
            f.status, f.leader = ReqStatus.PARKED, leader
        leader.followers = reqs[1:]
        self.groups[request_id] = reqs
        self.prompt_lp_groups += sampling.prompt_logprobs is not None
        self.waiting.append(leader)
        self.counters["prompt_tokens"] += len(prompt)
        self.counters["requests"] += 1

    def check_request(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> None:
        """ValueError naming the field if `add_request` would refuse this request (nothing is added)."""
        self._validate(request_id, prompt, sampling)

    def _validate(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: must be SamplingParams, got {type(sampling).__name__}")
        sampling.validate()
        self.limits.check(prompt, sampling.n, sampling.max_tokens, sampling.stop_token_ids, sampling.logit_bias or (),
                          sampling.min_tokens)

    @property
    def reserved_rows(self) -> int:
        return self.rows.reserved

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        if not self.running and not self.waiting:
            return None
        st = _Step(self.cfg.max_num_batched_tokens)
        self._schedule_running(st)
        if not st.preempted:
            self._admit_waiting(st)
        if not st.sched:
            return None
        return self._batch(st)

    def _schedule_running(self, st: _Step) -> None:
        """Decoders first (one token each), then requests in the middle of their prompt, oldest first."""
        ps, chunk, sched = self.cfg.page_size, self.cfg.chunked_prefill_size, st.sched
        prefilling = []
        for req in list(self.running):  # a copy: preemption removes from self.running
            if st.budget <= 0:
                return
            if req.status is not ReqStatus.RUNNING:
                continue  # preempted earlier in this loop
            if len(req.tokens) >= req.max_len:
                continue  # overlap: its token still on the way ends it (max_tokens / context) when resolved
            if len(req.tokens) - req.num_computed != 1:
                prefilling.append(req)
                continue
            n = self._decode_tokens(req, st)
            if req.num_computed + n > len(req.pages) * ps and not self._reserve(req, n, st):
                continue  # its last page is full and the pool is short even after preemption
            sched[req] = n
            st.budget -= n
        if sched and self.cfg.mixed_step_tokens:  # decodes ride this step: bound what prefills add to it
            cap = self.cfg.mixed_step_tokens
            st.budget = min(st.budget, max(cap - sum(sched.values()), cap // 4))
        for req in prefilling:
            if st.budget <= 0:
                return
            if req.status is not ReqStatus.RUNNING:
                continue
            n = min(req.num_pending, chunk, st.budget)
            if self._reserve(req, n, st):
                sched[req] = n
                st.budget -= n

    def _decode_tokens(self, req: Req, st: _Step) -> int:
        """A decoding request's tokens this step: its last one, and its drafts (speculative decoding, engine/mtp.py)
        where the budget, the mixed-step cap and the free pages take them (drafts never preempt anyone)."""
        k = len(req.drafts)
        if not k or st.budget <= k:
            return 1
        if st.draft_cap is None:  # a prompt waiting or mid-way: leave it the quarter of the cap it is promised
            cap = self.cfg.mixed_step_tokens
            pending = [len(r.tokens) - r.num_computed for r in self.running]
            st.decoders = pending.count(1)
            st.draft_cap = (cap - cap // 4 if self.waiting or max(pending) > 1 else cap) if cap else st.budget
        later = st.decoders - len(st.sched) - 1  # decodes after this one: one token each at least
        used = self.cfg.max_num_batched_tokens - st.budget  # the step's tokens so far (no sum over its rows)
        if used + 1 + k + later > st.draft_cap:
            return 1
        need = -(-(req.num_computed + 1 + k) // self.cfg.page_size) - len(req.pages)
        return 1 + k if need <= self.cache.num_available() else 1

    def _reserve(self, req: Req, n: int, st: _Step) -> bool:
        """Pages for `req`'s next n tokens, preempting newer running requests if short."""
        need = -(-(req.num_computed + n) // self.cfg.page_size) - len(req.pages)
        while need > self.cache.num_available():
            victim = self.running[-1]
            self._preempt(victim, st)
            if victim is req:
                return False
        if need > 0:
            req.pages += self.cache.allocate(need)
        return True

    def _admit_waiting(self, st: _Step) -> None:
        ps, cfg = self.cfg.page_size, self.cfg
        while self.waiting and st.budget > 0:
            req = self.waiting[0]
            free_rows = cfg.max_running_requests - len(self.running) - self.reserved_rows
            if free_rows < 1:
                return
            self.prompt_entries.fill(req)
            hits = self.cache.match(req.tokens, req.page_hashes, req.cacheable_tokens // ps)
            n = min(len(req.tokens) - len(hits) * ps, cfg.chunked_prefill_size, st.budget)
            need = -(-(len(hits) * ps + n) // ps) - len(hits)
            if need > self.cache.num_available():
                self.cache.release(hits)  # not admitted: the hit pages stay evictable for others
                return
            self.waiting.popleft()
            req.pages = hits + self.cache.allocate(need)
            req.num_computed = len(hits) * ps
            req.num_registered = len(hits)
            req.chain_uid = self.cache.uid(hits[-1]) if hits else 0
            if req.num_preemptions == 0:
                req.num_cached_tokens = len(hits) * ps
            self.counters["prefix_cache_hit_tokens"] += len(hits) * ps
            self._start_running(req)
            if req.followers:
                self.rows.reservations[req] = min(len(req.followers), free_rows - 1)
            st.sched[req] = n
            st.budget -= n

    def _start_running(self, req: Req) -> None:
        req.status = ReqStatus.RUNNING
        self.rows.take(req)
        bisect.insort(self.running, req, key=lambda r: r.priority)

    def _batch(self, st: _Step) -> ScheduledBatch:
        reqs, num_new = list(st.sched), list(st.sched.values())
        logit_reqs, sample_reqs, rows, drafts = [], [], [], []
        row = 0  # the logits row: one a sampling request, and one more for each draft riding along
        for req, n in st.sched.items():
            end = req.num_computed + n
            if end < len(req.tokens):
                continue
            logit_reqs.append(req)
            sample_reqs.append(req)
            rows.append(row)
            if end > len(req.tokens):  # the drafts' rows: the token after each, kept if the drafts up to it are
                assert not req.followers, "a leader drafts only after its followers forked"  # they read `row`
                drafts.append((req, end - len(req.tokens), row + 1))
                row += end - len(req.tokens)
            for f in self._followers_with_rows(req):  # the prompt is complete: they sample from it too
                sample_reqs.append(f)
                rows.append(row)
            row += 1
        self.counters["steps"] += 1
        return ScheduledBatch(reqs, num_new, logit_reqs, sample_reqs, rows, sum(num_new), drafts)

    def _followers_with_rows(self, leader: Req) -> list[Req]:
        """The leader's followers that fork this step: as many as rows are free now (its own reserved ones
        and any freed since); the others wait for a row as new requests do, ahead of later arrivals."""
        if not leader.followers:
            return []
        self.rows.reservations.pop(leader, None)
        fit = len(self.rows.free) - self.reserved_rows
        keep, rest = leader.followers[:fit], leader.followers[fit:]
        for f in reversed(rest):
            f.status, f.leader = ReqStatus.WAITING, None
            if leader.prompt_logprobs is not None:  # this step asks the leader's last entries: share them
                f.prompt_logprobs, f.prompt_lp_asked = leader.prompt_logprobs, leader.prompt_len - 1
            self.waiting.appendleft(f)
        leader.followers = keep
        if keep:
            self.rows.reservations[leader] = len(keep)
        return keep

    # ---- after the forward ---------------------------------------------------------------------
    def live_samples(self, sched: ScheduledBatch) -> tuple[list[Req], list[int]]:
        """The sample rows still wanted, and the logits row of each: a sample that finished after the batch
        was scheduled (overlap: its previous token, resolved since, was a stop) is not sampled."""
        if all(r.status is not ReqStatus.FINISHED for r in sched.sample_reqs):
            return sched.sample_reqs, sched.sample_logit_rows
        keep = [i for i, r in enumerate(sched.sample_reqs) if r.status is not ReqStatus.FINISHED]
        return [sched.sample_reqs[i] for i in keep], [sched.sample_logit_rows[i] for i in keep]

    def launched(self, sched: ScheduledBatch, samples: list[Req]) -> None:
        """The step is queued on the device: its tokens count as in KV (full pages go to the prefix cache; every
        token they hold is known), n>1 followers fork, and sample j gets the placeholder of sample row j
        (engine/overlap.py) until `resolve` brings its token."""
        computed = 0
        for req, n in zip(sched.reqs, sched.num_new, strict=True):
            if req.status is ReqStatus.FINISHED:  # overlap: it ended after it was scheduled; the row is wasted
                self.counters["overlap_discarded_tokens"] += n
                continue
            computed += n
            req.num_computed += min(n, len(req.tokens) - req.num_computed)  # a draft counts once it is kept
            self._register_full_pages(req)
        self.counters["computed_tokens"] += computed
        count_drafts(self.counters, [n for req, n, _ in sched.draft_rows if req.status is not ReqStatus.FINISHED])
        for j, req in enumerate(samples):
            if req.followers:
                self._fork(req)
            req.tokens.append(placeholder(j))

    def grow_pages(self, req: Req, tokens: int) -> bool:
        """Pages for req's first `tokens` positions, from what the pool has free (never a preemption): speculative
        decoding's chained drafts write the MTP layer's KV ahead of the request's tokens (engine/mtp.py), where the
        next step's drafts go anyway. Whether they are there."""
        need = -(-tokens // self.cfg.page_size) - len(req.pages)
        if need > self.alloc.num_free:  # free pages only: a draft never evicts the prefix cache
            return False
        if need > 0:
            req.pages += self.cache.allocate(need)
        return True

    def _register_full_pages(self, req: Req) -> None:
        """Offer the request's pages that its computed tokens filled to the prefix cache."""
        full = req.num_computed // self.cfg.page_size
        if full > req.num_registered and self.cache.enabled:
            req.chain_uid = self.cache.insert(req.pages, req.tokens, req.page_hashes, req.num_registered, full,
                                              req.chain_uid)
            req.num_registered = full

    def resolve(self, samples: list[Req], token_ids: list[int], logprobs: list[dict | None],
                kept_drafts: dict[Req, list[tuple[int, dict | None]]] | None = None) -> list[TokenDelta]:
        """The launched step's tokens reached the host: they replace the placeholders, then the finish checks
        (stop ids, EOS, max_tokens, context, a completed grammar) and one delta per sample. `kept_drafts`
        (speculative decoding, engine/mtp.py): a sample whose drafts equal the tokens just sampled has their KV
        computed, and takes the token sampled after each (token and logprobs) until one ends it."""
        deltas = []
        for req, tok, lp in zip(samples, token_ids, logprobs, strict=True):
            if req.status is ReqStatus.FINISHED:  # aborted while its token was on the way: dropped
                self.counters["overlap_discarded_tokens"] += 1
                continue
            req.tokens[-1] = tok
            finished = self._take(req, tok, lp)
            for pos, after in enumerate(kept_drafts.get(req, ()) if kept_drafts else ()):
                if finished:
                    break
                req.num_computed += 1  # the kept draft's KV is the last token's
                count_kept(self.counters, pos)
                self._register_full_pages(req)
                req.tokens.append(after[0])
                if req.grammar is not None:  # one token at a time: `_take` reads whether this one ended it
                    req.grammar.observe(after[0])
                finished = self._take(req, *after)
            if req.prompt_logprobs is not None and not req.prompt_lp_sent:
                self.prompt_entries.store(req)
            deltas.append(req.delta(finished))
        return deltas

    def _take(self, req: Req, tok: int, lp: dict | None) -> bool:
        """A sampled token, the last of req.tokens: its logprobs, then the finish checks; whether it ended req."""
        self.counters["generation_tokens"] += 1
        if lp is not None and req.pending_logprobs is not None:
            req.pending_logprobs.append(lp)
        if req.grammar is not None and req.grammar.terminated and tok not in req.stop_ids:
            self._finish(req, "stop")  # the grammar is complete (and ignore_eos kept EOS out of stop_ids)
            return True
        if tok in req.stop_ids or len(req.tokens) >= req.max_len:  # req.max_len <= max_seq_len
            reason = self._finish_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
                return True
        return False

    def _finish_reason(self, req: Req, tok: int) -> str | None:
        if tok in req.stop_ids and req.num_output > req.sampling.min_tokens:
            req.stop_reason = tok if tok in req.sampling.stop_token_ids else None
            return "stop"
        if len(req.tokens) >= req.max_len:
            return "length"
        return None

    def _fork(self, leader: Req) -> None:
        """Followers share the leader's full prompt pages and compute only the prompt's partial last page."""
        full = leader.prompt_len // self.cfg.page_size
        for f in leader.followers:
            f.pages = leader.pages[:full]
            for p in f.pages:
                self.cache.share(p)
            f.num_computed = full * self.cfg.page_size
            f.page_hashes = leader.page_hashes[:full]
            f.num_registered, f.chain_uid = 0, 0  # re-walked (verified, cheap) when its next page fills
            f.num_cached_tokens = leader.num_cached_tokens
            f.prompt_logprobs, f.prompt_lp_asked = leader.prompt_logprobs, leader.prompt_lp_asked  # computed once
            f.leader = None
            self._start_running(f)
        self.rows.reservations.pop(leader, None)
        leader.followers = []

    # ---- leaving the running set -----------------------------------------------------------
    def _release(self, req: Req) -> None:
        """Give back pages and row of a running request."""
        self.cache.release(req.pages)
        req.pages = []
        req.num_computed = req.num_registered = req.chain_uid = 0
        self.rows.give_back(req)
        req.drafts = []
        self.running.remove(req)
        self.rows.reservations.pop(req, None)  # parked followers wait for the leader's next admission

    def _preempt(self, req: Req, st: _Step) -> None:
        if req in st.sched:
            st.budget += st.sched.pop(req)
        self._release(req)
        req.status = ReqStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        st.preempted = True
        self.counters["preemptions"] += 1

    def _finish(self, req: Req, reason: str) -> None:
        if req.status is ReqStatus.RUNNING:
            self._release(req)
        elif req.status is ReqStatus.WAITING:  # overlap: preempted while its last token was on the way
            self.waiting.remove(req)
        req.status, req.finish_reason = ReqStatus.FINISHED, reason
        group = self.groups.get(req.request_id)
        if group is not None and all(r.status is ReqStatus.FINISHED for r in group):
            self._drop_group(req.request_id)

    def abort_request(self, request_id: str, index: int | None = None) -> bool:
        """Abort a request (or one of its n samples) wherever it is; its pages are free on return."""
        group = self.groups.get(request_id)
        if group is None:
            return False
        if index is not None and not 0 <= index < len(group):
            raise ValueError(f"index: request {request_id!r} has samples 0..{len(group) - 1}, got {index}")
        targets = group if index is None or group[index].followers else [group[index]]
        if len(targets) > 1:  # parked followers first: each unlinks itself from a leader still in place
            targets = targets[1:] + targets[:1]
        for req in targets:
            if req.status is ReqStatus.FINISHED:
                continue
            if req.status is ReqStatus.RUNNING:
                self._release(req)
            elif req.status is ReqStatus.WAITING:
                self.waiting.remove(req)
            elif req.status is ReqStatus.PARKED and req.leader is not None:
                req.leader.followers.remove(req)
                self.rows.shrink_reservation(req.leader)
            req.drop_placeholder()  # overlap: its token still on the way is dropped, never reported
            req.followers = []
            req.status, req.finish_reason = ReqStatus.FINISHED, "abort"
            self._abort_deltas.append(req.delta(True))
        if all(r.status is ReqStatus.FINISHED for r in group):
            self._drop_group(request_id)
        self.counters["aborted" if index is None else "aborted_samples"] += 1  # whole request / one sample
        return True

    def _drop_group(self, request_id: str) -> None:
        """Every sample of the request finished."""
        self.prompt_lp_groups -= self.groups.pop(request_id)[0].sampling.prompt_logprobs is not None

    def take_abort_deltas(self) -> list[TokenDelta]:
        out, self._abort_deltas = self._abort_deltas, []
        return out

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._abort_deltas)

    # ---- observability (engine/scheduler_audit.py) ---------------------------------------------
    def stats(self) -> dict:
        return scheduler_stats(self)

    def check_no_leak(self) -> None:
        """AssertionError unless every page is free or held only by the prefix cache, and nothing is left."""
        check_no_leak(self)
