"""Engine: the in-process, offline front of the engine core (`dsaserve.Engine`; request path 1-10 in one
process: tokenize -> EngineCore steps -> incremental detokenize + stop strings).

Owns: prompt handling (text or token ids, one or a batch), request ids, turning TokenDeltas into
RequestOutputs (token ids, text, finish reason, logprobs; `n` > 1 -> several outputs), stop strings
(matched on the detokenized text here; the sample is then aborted in the core and reported as "stop"),
and the streaming iterator. Usage:

    from dsaserve import Engine, SamplingParams
    llm = Engine(model="glm-5.3-tiny", kv_layout="bf16", num_pages=64)
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(temperature=0, max_tokens=8))
    outs[0].text, outs[0].token_ids, outs[0].finish_reason, outs[1].outputs[0].logprobs
    for o in llm.stream("Hello", SamplingParams(max_tokens=8)): print(o.outputs[0].delta_text, end="")

Lower level, as vLLM's LLMEngine: `add_request(prompt, params) -> request_id`, `step() -> [updated
RequestOutput]`, `abort(request_id)`, `has_unfinished()`; `kv_pool_info()` -> the runner's KVPoolInfo.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.incremental_detokenizer import IncrementalDetokenizer
from dsaserve.engine.kv_pool import KVPoolInfo
from dsaserve.engine.rank_group import RankGroup
from dsaserve.engine.request import TokenDelta

Prompt = str | list[int]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict] | None = None
    delta_text: str = ""  # what the last update added (streaming)
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    # SamplingParams.prompt_logprobs: per prompt token None (the first) or {"logprob", "rank", "top"} (vLLM's)
    prompt_logprobs: list[dict | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)

    # the first sample, for the common n == 1 case
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict] | None:
        return self.outputs[0].logprobs


class _Tracked:
    def __init__(self, out: RequestOutput, detoks: list[IncrementalDetokenizer | None]):
        self.out, self.detoks = out, detoks


class Engine:
    """With `tensor_parallel_size` / `expert_parallel_size` > 1 this process is rank 0 (the leader) and one
    follower process per other rank is spawned here (engine/rank_worker.py); `close()` stops them."""

    def __init__(self, model: str = "glm-5.3-mini", *, runner: Any = None, **engine_args: Any):
        self.args = EngineArgs.from_kwargs(model=model, **engine_args)
        self._followers = self._spawn_followers() if self.args.world_size > 1 and runner is None else []
        try:
            self.core = EngineCore(self.args, runner=runner, rank=0 if self._followers else None)
            self.group = RankGroup(self.core, self.args.enable_dp_attention, self.args.dist_timeout)
        except BaseException:
            self._kill_followers()
            raise
        self.tokenizer = self.core.tokenizer
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self._held: list[TokenDelta] = []  # deltas stepped while a request waited for its grammar

    def _spawn_followers(self) -> list:
        if self.args.nnodes > 1:
            raise ValueError("--nnodes: the offline Engine runs on one machine; span nodes with `dsaserve serve`")
        from dataclasses import asdict

        from dsaserve.common.wire import free_port
        from dsaserve.engine.rank_worker import spawn_followers
        from dsaserve.weights.checkpoint_cache import resolve_model_dir

        self.args.model = str(resolve_model_dir(self.args.model, self.args.load_format))  # built once, here
        if not self.args.dist_init_addr:
            self.args.dist_init_addr = f"127.0.0.1:{free_port()}"
        return spawn_followers(asdict(self.args), self.args.world_size)

    def close(self) -> None:
        """Stop the follower ranks (a no-op with one rank). The Engine is unusable afterwards."""
        if self._followers and not self.group.stopped:
            self.group.stop()
            self.group.step()
            for p in self._followers:
                p.wait(timeout=30)
        self._kill_followers()
        if self._followers:
            from dsaserve.distributed.parallel_state import shutdown_distributed

            shutdown_distributed()

    def _kill_followers(self) -> None:
        for p in self._followers:
            if p.poll() is None:
                p.kill()
                p.wait()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- low level ---------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = sampling_params if sampling_params is not None else SamplingParams()
        text, ids = self._tokenize(prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.group.add_request(rid, ids, params, time.time())
        if self.group.waiting(rid):
            self._await_grammar(rid)
        has_text = self.tokenizer is not None
        detoks = [IncrementalDetokenizer.for_params(self.tokenizer, ids, params) if has_text else None
                  for _ in range(params.n)]
        outputs = [CompletionOutput(i, logprobs=[] if params.logprobs is not None else None) for i in range(params.n)]
        self._tracked[rid] = _Tracked(RequestOutput(rid, text, ids, outputs), detoks)
        return rid

    def step(self) -> list[RequestOutput]:
        """One engine step; the (cumulative) outputs of the requests it touched."""
        touched: dict[str, RequestOutput] = {}
        deltas, self._held = self._held + self.group.step()[0], []
        for d in deltas:
            tr = self._tracked.get(d.request_id)
            if tr is None:
                continue
            self._apply(tr, d)
            touched[d.request_id] = tr.out
            if tr.out.finished:
                del self._tracked[d.request_id]
        return list(touched.values())

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its outputs finish with finish_reason "abort"."""
        return self.group.abort_request(request_id)

    def has_unfinished(self) -> bool:
        """Whether a request added here has not finished yet."""
        return bool(self._tracked)

    def kv_pool_info(self) -> KVPoolInfo:
        """The model runner's KV pool: layout, pages, tokens, bytes per token and in all (ledger reconcile)."""
        pool = getattr(self.core.runner, "kv_pool", None)
        if pool is None:
            raise RuntimeError(f"kv_pool_info: the runner ({type(self.core.runner).__name__}) has no KV pool")
        return pool.info()

    # ---- batch and streaming -------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion (served together, continuously batched); outputs in prompt order."""
        final: dict[str, RequestOutput] = {}
        rids = self._add_all(prompts, sampling_params)
        pending = set(rids)
        try:
            while pending:
                for out in self.step():
                    if out.finished and out.request_id in pending:
                        final[out.request_id] = out
                        pending.discard(out.request_id)
        finally:
            for rid in pending:  # an exception mid-way must not leave requests holding pages
                self.group.abort_request(rid)
                self._tracked.pop(rid, None)
        return [final[r] for r in rids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield each touched request's cumulative output after every step (`delta_text` / `delta_token_ids`
        hold the news). Closing the iterator early aborts what is still running."""
        rids = self._add_all(prompts, sampling_params)
        pending = set(rids)
        try:
            while pending:
                for out in self.step():
                    if out.request_id in pending:
                        if out.finished:
                            pending.discard(out.request_id)
                        yield out
        finally:
            for rid in pending:
                self.group.abort_request(rid)
                self._tracked.pop(rid, None)

    # ---- internals -------------------------------------------------------------------------------
    def _await_grammar(self, rid: str) -> None:
        """A structured request is admitted once every rank compiled its grammar (engine/grammar_gate.py):
        step until then — other requests go on, their deltas kept for the next `step()` — and raise the
        reason (ValueError) if it is refused, as a request the scheduler refuses is."""
        while self.group.waiting(rid):
            deltas, _ = self.group.step()
            self._held += deltas
            if not deltas and not self.core.has_unfinished():
                time.sleep(0.001)  # only the compile's thread has work: leave it the CPU
        for r, reason in self.group.take_rejects():
            if r == rid:
                raise ValueError(reason)

    def _add_all(self, prompts: Any, params: Any) -> list[str]:
        batch = [prompts] if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)) else list(prompts)
        if not batch:
            raise ValueError("prompts: no prompt given")
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"sampling_params: {len(plist)} given for {len(batch)} prompts")
        rids: list[str] = []
        try:
            for p, sp in zip(batch, plist, strict=True):
                rids.append(self.add_request(p, sp))
        except Exception:
            for rid in rids:  # all or nothing
                self.group.abort_request(rid)
                self._tracked.pop(rid, None)
            raise
        return rids

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            enc = self.tokenizer.encode(prompt)
            return prompt, list(getattr(enc, "ids", enc))  # a `tokenizers.Tokenizer` returns an Encoding
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")

    def _apply(self, tr: _Tracked, d: TokenDelta) -> None:
        out = tr.out.outputs[d.index]
        tr.out.num_cached_tokens = d.cached_tokens
        if d.prompt_logprobs is not None:
            tr.out.prompt_logprobs = d.prompt_logprobs
        if out.finished:  # e.g. the abort that follows a stop-string match
            out.delta_text, out.delta_token_ids = "", []
            return
        finish, stop_reason = d.finish_reason if d.finished else None, d.stop_reason
        new_ids, new_lps = list(d.new_token_ids), d.new_logprobs
        detok = tr.detoks[d.index]
        if detok is not None:
            before = detok.num_tokens
            # the core finishes with "stop" only on a stop token (EOS / stop_token_ids), the delta's last id
            hit = detok.add(new_ids, final=d.finished, stop_terminated=d.finished and d.finish_reason == "stop")
            if hit is not None:
                if finish is None:  # the core does not know text: end this sample there
                    self.group.abort_request(d.request_id, d.index)
                finish, stop_reason = "stop", hit
                used = detok.num_tokens - before  # ids after the one that completed the stop string are dropped
                new_ids, new_lps = new_ids[:used], new_lps[:used] if new_lps else new_lps
            out.delta_text = detok.delta(finish is not None)
            out.text = detok.text if finish is not None else detok.text[: detok.emitted]
        out.token_ids += new_ids
        out.delta_token_ids = new_ids
        if out.logprobs is not None and new_lps:
            out.logprobs += new_lps
        if finish is not None:
            out.finish_reason, out.stop_reason = finish, stop_reason

