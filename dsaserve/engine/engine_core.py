"""EngineCore: one scheduler + one model runner + the sampler, stepped by its owner (request path 3-10).

Owns: the step loop's body — schedule (engine/scheduler.py) -> build the ForwardBatch (engine/batch.py)
-> model forward (engine/model_runner.py) -> sample (model/sampler.py) -> per-request deltas, either
synchronously or overlapped: step N+1 scheduled and launched before step N's tokens reach the host
(--disable-overlap-schedule; engine/overlap.py has the order and what it costs). It does no
text work: stop *strings* are matched by whoever detokenizes (the offline `Engine`, or the server's
detokenizer process), which then calls `abort_request`. Single-threaded by design: the owner (the
offline Engine, or the server's scheduler process loop) calls add/abort/step from one thread.

API (the server, issue 4, builds on exactly this):

    core = EngineCore(EngineArgs(model="glm-5.3-tiny", ...))      # or EngineCore(args, runner=fake)
    core.scheduler_info  -> {"max_req_input_len", "max_total_tokens", "max_model_len",
                             "max_running_requests", "page_size", "num_pages", "kv_layout",
                             "startup_time": {phase: seconds}, ...}
    core.add_request(EngineRequest(request_id, prompt_token_ids, SamplingParams(...), arrival_time))
        ValueError (message names the field) for an empty prompt, a token id outside the vocabulary,
        a prompt longer than max_req_input_len, prompt + max_tokens over the context, n too large,
        a duplicate request_id. The core stays usable after any of them.
    core.abort_request(request_id, index=None) -> bool
                                             # frees its pages at once (all n samples, or one); the next
                                             # step() reports TokenDelta(finished=True, finish_reason="abort")
    core.step() -> list[TokenDelta]          # one forward (or none when idle); at most one delta per
                                             # running sample that produced a token or finished — under
                                             # overlap, the tokens of the step before (so one more step()
                                             # after the last forward collects the last tokens)
    core.has_unfinished() -> bool            # requests in flight, or a launched step not yet collected
    core.stats() -> dict                     # num_running, num_waiting, kv_pages_used/cached/free/total,
                                             # prefix_cache_hit_tokens, evicted_pages, preemptions,
                                             # prompt_tokens, generation_tokens, computed_tokens, steps,
                                             # overlap_schedule, overlap_steps, overlap_discarded_tokens
    core.check_no_leak()                     # AssertionError unless every page is free or held only by
                                             # the prefix cache and no request / row is left
    core.tokenizer / core.eos_token_ids / core.cfg   # from the runner
    core.grammars -> GrammarCompiler          # built on first use (or at startup for --precompile-schemas);
                                             # add_request takes the grammar the gate compiled (or compiles
                                             # the spec, cached) and gives each sample its GrammarState
    core.manifest() -> dict                  # runner manifest + scheduler_info + KV pool info
"""

from __future__ import annotations

import time
from typing import Any

import torch

from dsaserve.common.host_lists import to_device
from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine import prompt_logprobs
from dsaserve.engine.batch import BatchBuilder
from dsaserve.engine.device_timer import DeviceTimer
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.grammar import GrammarCompiler, GrammarError, GrammarSpec, load_precompile_file
from dsaserve.engine.mtp import MTPDrafter
from dsaserve.engine.request import EngineRequest, Req, TokenDelta
from dsaserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from dsaserve.model.sampler import SampleFuture, Sampler

__all__ = ["EngineCore", "EngineRequest", "TokenDelta", "SamplingParams", "EngineArgs"]


def build_runner(args: EngineArgs, rank: int | None = None) -> Any:
    """The real ModelRunner for these args (imported here: tests inject a fake runner instead)."""
    from dsaserve.engine.model_runner import ModelRunner

    return ModelRunner(args, rank=rank)


def _rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The logits rows the samples read, in their order (n>1 forks reuse a row, finished samples drop theirs, a
    draft's row follows its request's): the logits as they are when that is every row in order."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, to_device(rows, torch.int64, logits.device))


def _overlap(args: EngineArgs, runner: Any) -> bool:
    """Overlap scheduling needs a runner that reads placeholder input ids from its `future_token_ids`; by
    default it is on where that buffer is on a GPU (a test's fake runner on a GPU machine stays synchronous)."""
    future = getattr(runner, "future_token_ids", None)
    if future is None or args.speculative_algorithm is not None:
        return False
    return future.is_cuda if args.disable_overlap_schedule is None else not args.disable_overlap_schedule


class EngineCore:
    def __init__(self, args: EngineArgs, runner: Any | None = None, rank: int | None = None):
        self.args = args
        self.runner = runner if runner is not None else build_runner(args, rank)
        t0 = time.perf_counter()  # the runner timed its own phases: engine_core is what comes after them
        cfg = self.runner.cfg
        context = getattr(self.runner, "max_model_len", None) or args.max_model_len or cfg.max_position_embeddings
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=self.runner.num_pages, page_size=self.runner.page_size,
            max_num_batched_tokens=args.max_num_batched_tokens, chunked_prefill_size=args.chunk_size,
            max_running_requests=args.max_running_requests, max_model_len=context,
            mixed_step_tokens=args.resolved_mixed_step_tokens(),
            enable_prefix_caching=args.enable_prefix_caching, vocab_size=cfg.vocab_size,
            eos_token_ids=tuple(self.runner.eos_token_ids)))
        self.builder = BatchBuilder(args.max_running_requests, self.scheduler.max_pages_per_seq,
                                    self.runner.page_size)
        self.sampler = Sampler(seed=args.seed)
        self.device_timer = DeviceTimer(torch.device(self.runner.device))
        self.overlap = _overlap(args, self.runner)
        self.overlap_steps = 0
        self.mtp = (MTPDrafter(self.runner, self.scheduler, args.speculative_num_steps)
                    if args.speculative_algorithm is not None else None)
        # launched, tokens (and prompt entries) not yet on the host
        self._pending: tuple[list[Req], SampleFuture | None, prompt_logprobs.PromptLogprobsFuture | None] | None = None
        self._grammars: GrammarCompiler | None = None
        self.warmed_schemas = 0
        self._startup = dict(getattr(self.runner, "startup_time", {}) or {})
        self._startup["engine_core"] = time.perf_counter() - t0
        if args.precompile_schemas:
            t1 = time.perf_counter()
            self.warmed_schemas = self._precompile(args.precompile_schemas)
            self._startup["grammar_warmup"] = time.perf_counter() - t1

    # ---- what the runner knows -------------------------------------------------------------
    @property
    def cfg(self) -> Any:
        return self.runner.cfg

    @property
    def tokenizer(self) -> Any:
        return getattr(self.runner, "tokenizer", None)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.runner.eos_token_ids)

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler over this model's vocabulary (ValueError if the checkpoint has no tokenizer)."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer, so no grammar can be compiled")
            self._grammars = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, list(self.eos_token_ids),
                                             timeout_s=self.args.grammar_compile_timeout)
        return self._grammars

    def _precompile(self, path: str) -> int:
        """The startup warmup of --precompile-schemas: every spec compiled now; a bad one is a startup error."""
        specs = load_precompile_file(path)
        for i, spec in enumerate(specs):
            try:
                self.grammars.compile(spec)
            except GrammarError as e:
                raise ValueError(f"--precompile-schemas: entry {i} of {path}: {e}") from None
        return len(specs)

    @property
    def max_req_input_len(self) -> int:
        return self.scheduler.max_req_input_len

    @property
    def scheduler_info(self) -> dict[str, Any]:
        s = self.scheduler
        return {
            "max_req_input_len": s.max_req_input_len,
            "max_total_tokens": s.cfg.num_pages * s.cfg.page_size,
            "max_model_len": s.max_seq_len,
            "max_running_requests": s.cfg.max_running_requests,
            "max_num_batched_tokens": s.cfg.max_num_batched_tokens,
            "chunked_prefill_size": s.cfg.chunked_prefill_size,
            "page_size": s.cfg.page_size,
            "num_pages": s.cfg.num_pages,
            "kv_layout": self.args.kv_layout,
            "enable_prefix_caching": s.cfg.enable_prefix_caching,
            "overlap_schedule": self.overlap,
            "speculative_algorithm": self.args.speculative_algorithm,
            "vocab_size": s.cfg.vocab_size,
            "eos_token_ids": list(self.eos_token_ids),
            "startup_time": dict(self._startup),
            "warmed_schemas": self.warmed_schemas,
            "grammar_compile_timeout": self.args.grammar_compile_timeout,
        }

    def manifest(self) -> dict[str, Any]:
        m = dict(self.runner.manifest()) if hasattr(self.runner, "manifest") else {}
        m["scheduler_info"] = self.scheduler_info
        pool = getattr(self.runner, "kv_pool", None)
        if pool is not None and hasattr(pool, "info"):
            m.setdefault("kv_pool", pool.info().__dict__)
        return m

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, req: EngineRequest, grammar: tuple[GrammarSpec, Any] | None = None) -> None:
        """ValueError naming the field for a request the scheduler refuses or whose grammar does not compile.
        `grammar`: the request's (spec, compiled grammar), as the grammar gate (engine/grammar_gate.py) has it
        once every rank compiled it — the spec is not parsed again and nothing compiles here. Without it a
        structured request's spec is parsed and compiled now, blocking up to --grammar-compile-timeout (an
        EngineCore driven directly, without a RankGroup)."""
        so = req.sampling.structured_outputs
        if so is not None and grammar is None:
            self.scheduler.check_request(req.request_id, req.prompt_token_ids, req.sampling)  # before a compile
            try:
                spec = GrammarSpec.from_dict(so)
                grammar = (spec, self.grammars.compile(spec))
            except ValueError as e:  # GrammarError, or a model without a tokenizer
                raise ValueError(f"structured_outputs: {e}") from None
        self.scheduler.add_request(req.request_id, req.prompt_token_ids, req.sampling, req.arrival_time)
        if so is not None:
            spec, compiled = grammar
            for r in self.scheduler.groups[req.request_id]:
                r.grammar = self.grammars.state(compiled, spec, so.get("after"))

    def abort_request(self, request_id: str, index: int | None = None) -> bool:
        """Abort all samples of a request (or sample `index` only); False if it is not in flight."""
        return self.scheduler.abort_request(request_id, index)

    def has_unfinished(self) -> bool:
        """Requests in flight, or a launched step whose tokens the next `step()` collects."""
        return self.scheduler.has_unfinished() or self._pending is not None

    # ---- the step --------------------------------------------------------------------------
    def step(self, idle_forward: bool = False) -> list[TokenDelta]:
        """One scheduled forward and the deltas of the step before it (overlap; engine/overlap.py has the
        order) or of this one (synchronous). `idle_forward`: with nothing scheduled, still run the model's
        empty step (DP-attention: every rank takes part in every step's MoE collectives)."""
        deltas = self.scheduler.take_abort_deltas()
        sched = self.scheduler.schedule()
        if sched is None:
            if idle_forward:
                self.runner.forward_idle()
                if self.mtp is not None:
                    self.mtp.idle()
            return deltas + self._resolve()
        t = self.device_timer.start()
        batch = self.builder.build(sched)
        prompt = (prompt_logprobs.prompt_rows(sched.reqs, sched.num_new) if self.scheduler.prompt_lp_groups
                  else None)
        if prompt is not None:
            prompt.ask(batch)
        if self.mtp is not None:
            deltas += self._speculative_step(sched, batch, prompt)
            self.device_timer.stop(t)
            return deltas
        logits = self.runner.forward(batch)  # a host batch: the runner copies it over
        if prompt is not None:
            prompt = prompt_logprobs.PromptLogprobsFuture(prompt, self.runner.last_prompt_logprobs)
        deltas += self._resolve()  # overlap: the previous step's tokens, waited for while this forward runs
        self._launch_sample(sched, logits, prompt)
        self.device_timer.stop(t)
        if not self.overlap:
            deltas += self._resolve()
        return deltas

    def _launch_sample(self, sched: ScheduledBatch, logits: torch.Tensor,
                       prompt: prompt_logprobs.PromptLogprobsFuture | None = None) -> None:
        """Queue the sampling of the rows still wanted; their tokens become the next step's placeholders."""
        samples, rows = self.scheduler.live_samples(sched)
        future = self.sampler.sample_async(_rows_of(logits, rows), samples) if samples else None
        if self.overlap:
            self.overlap_steps += 1
            if future is not None:
                self.runner.future_token_ids[: len(samples)].copy_(future.tokens, non_blocking=True)
        self.scheduler.launched(sched, samples)
        self._pending = (samples, future, prompt)

    def _speculative_step(self, sched: ScheduledBatch, batch: Any, prompt: Any) -> list[TokenDelta]:
        """A step with drafts (engine/mtp.py): verify them in the forward, sample every row and each draft's next
        row (waiting for the samples), keep the drafts the samples agree with, then queue the MTP layer's extend and
        next drafts, whose values the next step takes once its forward is launched."""
        starts = [req.num_computed for req in sched.reqs]
        logits, hidden = self.runner.forward_with_hidden(batch)
        self.mtp.materialize()  # the drafts this forward verifies (their placeholders resolved on the device)
        if prompt is not None:
            prompt = prompt_logprobs.PromptLogprobsFuture(prompt, self.runner.last_prompt_logprobs)
        samples, rows = self.scheduler.live_samples(sched)
        sources, rows = self.mtp.sample_rows(sched, samples, rows)
        out = self.sampler.sample(_rows_of(logits, rows), sources) if sources else None
        self.scheduler.launched(sched, samples)
        if prompt is not None:
            prompt.attach()
        kept = self.mtp.kept(sources, out) if out is not None else {}
        deltas = []
        if out is not None:
            k = len(samples)
            deltas = self.scheduler.resolve(samples, out.token_ids[:k], out.logprobs[:k], kept)
        self.mtp.extend(sched, batch, hidden, starts, kept)
        return deltas

    def _resolve(self) -> list[TokenDelta]:
        """The launched step's tokens on the host (waiting for them) -> finish checks and deltas."""
        if self._pending is None:
            return []
        (samples, future, prompt), self._pending = self._pending, None
        if prompt is not None:  # before the deltas: a prompt's last chunk samples its first token in the same step
            prompt.attach()
        if future is None:
            return []
        out = future.result()
        return self.scheduler.resolve(samples, out.token_ids, out.logprobs)

    # ---- observability ---------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        g = self._grammars.stats if self._grammars is not None else {}
        return {**self.scheduler.stats(), "overlap_schedule": self.overlap, "overlap_steps": self.overlap_steps,
                "grammar_compiles": g.get("misses", 0),
                "grammar_cache_hits": g.get("hits", 0), "grammar_compile_failures": g.get("failures", 0),
                "grammar_compile_timeouts": g.get("timeouts", 0)}

    def check_no_leak(self) -> None:
        self.scheduler.check_no_leak()
