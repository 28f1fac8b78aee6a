"""Processor: an OpenAI request -> one GenerateRequest, validated and tokenized once (request path stage 1).

Owns: every check made at the door, in order, before any GPU work and before a stream's 200 — model
name, options this server does not support, `n` / stop_token_ids against this engine's limits, the bytes
of prompt text against what `max_req_input_len` tokens can possibly hold (413 before tokenizing: a 7 MB
prompt must not cost seconds of tokenizer time), token ids against the vocabulary, prompt and context
lengths against the scheduler's own ruler (`common/request_limits.py`, from its `scheduler_info`), and the
mapping onto SamplingParams (its ValueError names the field -> 400), the chat features' plan (tools /
tool_choice / response_format / structured_outputs, server/chat_features.py) with the family's chat encoder,
and a structured-output grammar compiled by the scheduler before the request is accepted (a bad or hostile
one is a 400 with the reason, before any 200). Tokenisation and chat-template rendering of large texts run
on a small thread pool, never on the event loop, so /health and every stream stay live meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import cached_property
from typing import Any

from dsaserve.common.request_limits import LimitError, RequestLimits
from dsaserve.common.sampling_params import SamplingParams, logit_bias_ids
from dsaserve.server.chat_encoding.glm5 import TemplateEncoder
from dsaserve.server.chat_features import ChatPlan, ChatPlanError, ChatSettings, format_grammar, plan_chat
from dsaserve.server.hf_tokenizer import ChatTemplateError, HFTokenizer
from dsaserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request
from dsaserve.server.request_state import GenerateRequest, Prompt

OFFLOAD_CHARS = 1 << 14  # texts longer than this are tokenized / rendered on the pool (~ms of work)
TOKENIZER_THREADS = 2  # huge prompts queue here instead of taking every core from the loop and the engine
BYTES_SLACK = 2  # a normalizer may compose characters (NFC): allow twice the longest token's bytes per token


GrammarCheck = Callable[[dict[str, str]], Awaitable[str | None]]  # spec -> None (compiled) or the reason


class Processor:
    def __init__(self, tok: HFTokenizer, scheduler_info: Callable[[], dict[str, Any]],
                 chat: ChatSettings | None = None, grammar_check: GrammarCheck | None = None) -> None:
        self.tok = tok
        self.info = scheduler_info
        self.chat_settings = chat or ChatSettings(None, TemplateEncoder(tok), None, None)
        self.grammar_check = grammar_check
        self.pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self.token_bytes = max(int(tok.max_token_bytes), 4)  # a walk over the vocabulary: once, at startup

    # ---- the two endpoints --------------------------------------------------------------------
    async def completion(self, req: CompletionRequest) -> GenerateRequest:
        if req.suffix:
            raise bad_request("suffix: not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of: only best_of == n is supported", "best_of")
        self._check_common(req)
        fmt = _plan_or_400(format_grammar, req)
        prompts = await self._completion_prompts(req.prompt)
        max_tokens = self._check_prompts(prompts, req, req.max_tokens, "prompt")
        # echo with logprobs: the prompt's tokens get entries too (lm-eval-harness's loglikelihood requests)
        prompt_k = max((k for k in (req.prompt_logprobs, req.logprobs if req.echo else None) if k is not None),
                       default=None)
        sampling = self.sampling(req, req.max_tokens, req.logprobs, fmt[1] if fmt else None, prompt_k)
        if fmt:
            await self._check_grammar(*fmt)
        if req.echo:
            for p in prompts:
                p.text = p.text if p.text is not None else self.tok.decode(p.ids, skip_special_tokens=False)
        return GenerateRequest(f"cmpl-{uuid.uuid4().hex}", prompts, sampling, max_tokens,
                               logprobs=req.logprobs is not None, stream=req.stream,
                               echo=req.echo, prompt_logprobs=req.prompt_logprobs, **_usage_options(req))

    async def chat(self, req: ChatCompletionRequest) -> GenerateRequest:
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
        self._check_common(req)
        plan = _plan_or_400(plan_chat, req, self.chat_settings.tool_parser, self.chat_settings.reason_first)
        prompt, thinking = await self._chat_prompt(req, plan)
        if plan.grammar is not None and thinking:  # the grammar starts when the reasoning ends
            plan.grammar = {**plan.grammar, "after": self.chat_settings.think_end_id}
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self._check_prompts([prompt], req, requested, "messages",
                                         "max_completion_tokens" if req.max_completion_tokens is not None else None)
        sampling = self.sampling(req, requested, (req.top_logprobs or 0) if req.logprobs else None, plan.grammar,
                                 req.prompt_logprobs)
        if plan.grammar is not None:
            await self._check_grammar(plan.grammar_source or "structured_outputs", plan.grammar)
        return GenerateRequest(f"chatcmpl-{uuid.uuid4().hex}", [prompt], sampling, max_tokens,
                               logprobs=req.logprobs, stream=req.stream, prompt_logprobs=req.prompt_logprobs,
                               **_usage_options(req),
                               chat=self.chat_settings.readback(plan, thinking))

    async def _check_grammar(self, param: str, spec: dict[str, str]) -> None:
        """400 naming `param` when the scheduler cannot compile the grammar (invalid, hostile, timed out)."""
        if self.grammar_check is None:
            return
        error = await self.grammar_check(spec)
        if error is not None:
            raise bad_request(f"{param}: {error}", param, "invalid_grammar")

    # ---- checks -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (the scheduler's word once Up; the tokenizer's before)."""
        return int(self.info().get("vocab_size") or self.tok.vocab_size)

    def limits(self) -> RequestLimits:
        """The scheduler's own ruler (common/request_limits.py), from what it reported."""
        return RequestLimits.from_info(self.info(), self.vocab_size)

    def _check_common(self, req: Any) -> None:
        """Options both endpoints refuse, and this engine's limits: n per prompt within
        max_running_requests (the scheduler would refuse it only after a stream's 200), every stop token id
        and logit_bias id inside the vocabulary (the sampler indexes with them). Seed + n is SamplingParams'
        own check."""
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")
        with _limit_400():
            limits = self.limits()
            limits.check_n(req.n)
            limits.check_ids(req.stop_token_ids or [], "stop_token_ids", allow_empty=True)
            limits.check_ids(list(_bias(req.logit_bias)), "logit_bias", allow_empty=True)

    def _check_prompts(self, prompts: list[Prompt], req: Any, max_tokens: int | None, param: str,
                       tokens_field: str | None = None) -> int:
        """Ids and lengths of every prompt, as the scheduler will check them, and min_tokens against what the
        context leaves; returns max_tokens resolved (the longest prompt's: None -> what is left of the context).
        `tokens_field`: the request field max_tokens came from, for the error."""
        limits, resolved = self.limits(), []
        with _limit_400():
            for p in prompts:
                limits.check_ids(p.ids, param)
                resolved.append(limits.check_lengths(len(p.ids), max_tokens, param, tokens_field or "max_tokens",
                                                     req.min_tokens or 0))
        return min(resolved)

    @cached_property
    def max_text_bytes(self) -> int:
        """No text longer than this can tokenize to max_req_input_len tokens or fewer."""
        return int(self.info()["max_req_input_len"]) * self.token_bytes * BYTES_SLACK

    def _check_text_bytes(self, size: int, param: str) -> None:
        if size > self.max_text_bytes:
            raise APIError(413, f"{param}: {size} bytes of text cannot fit this server's max_req_input_len of "
                           f"{self.info()['max_req_input_len']} tokens (at most {self.max_text_bytes} bytes)",
                           "invalid_request_error", param, "context_length_exceeded")

    @staticmethod
    def sampling(req: Any, max_tokens: int | None, logprobs: int | None,
                 structured: dict[str, str] | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        values = {
            "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "min_p": req.min_p, "seed": req.seed, "repetition_penalty": req.repetition_penalty,
            "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
            "max_tokens": max_tokens, "min_tokens": req.min_tokens, "stop": stop,
            "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos, "logprobs": logprobs,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens, "structured_outputs": structured,
            "logit_bias": req.logit_bias, "prompt_logprobs": prompt_logprobs,
        }
        keep_none = {"max_tokens", "logprobs", "seed"}  # None means something for these
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None or k in keep_none})
        except ValueError as e:
            param = str(e).split(":", 1)[0]
            raise bad_request(str(e), param if param.isidentifier() else None) from None

    # ---- tokenisation -------------------------------------------------------------------------
    async def _off_loop(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        if size < OFFLOAD_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def encode_text(self, text: str, param: str, add_special_tokens: bool = True) -> Prompt:
        if not text:
            raise bad_request(f"{param}: must not be empty", param)
        self._check_text_bytes(_utf8_len(text), param)
        return Prompt(await self._off_loop(len(text), self.tok.encode, text, add_special_tokens), text)

    async def _completion_prompts(self, prompt: Any) -> list[Prompt]:
        if isinstance(prompt, str):
            return [await self.encode_text(prompt, "prompt")]
        if not prompt:
            raise bad_request("prompt: must not be empty", "prompt")
        if isinstance(prompt[0], str):
            self._check_text_bytes(sum(_utf8_len(p) for p in prompt), "prompt")
            return [await self.encode_text(p, "prompt") for p in prompt]
        if isinstance(prompt[0], int):
            return [Prompt(list(prompt))]
        return [Prompt(list(p)) for p in prompt]

    async def _chat_prompt(self, req: ChatCompletionRequest, plan: ChatPlan) -> tuple[Prompt, bool]:
        """The prompt of the conversation (the family's encoder) and whether it opened <think>."""
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_request("continue_final_message: cannot be combined with add_generation_prompt",
                              "continue_final_message")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        size = sum(_message_bytes(m) for m in messages)
        self._check_text_bytes(size, "messages")
        for d in messages:
            d["role"] = "system" if d["role"] == "developer" else d["role"]  # templates know 'system'
        clash = sorted(set(plan.template_kwargs) & {"messages", "add_generation_prompt", "continue_final_message",
                                                    "tools"})
        if clash:
            raise bad_request(f"chat_template_kwargs: {clash[0]!r} is a request field, set it there",
                              "chat_template_kwargs")
        try:
            enc = await self._off_loop(size, lambda: self.chat_settings.encoder.encode(
                messages, tools=plan.tools, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, kwargs=plan.template_kwargs))
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        ids = await self.encode_text(enc.text, "messages", add_special_tokens=False) if enc.text else None
        if ids is None or not ids.ids:  # add_special_tokens=False: the template already has BOS etc.
            raise bad_request("messages: the chat template rendered an empty prompt", "messages")
        return ids, enc.thinking


@contextlib.contextmanager
def _limit_400() -> Iterator[None]:
    """A LimitError -> 400 naming its field, with its error code (context_length_exceeded)."""
    try:
        yield
    except LimitError as e:
        raise bad_request(str(e), e.field, e.code) from None


def _plan_or_400(fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except ChatPlanError as e:
        raise bad_request(str(e), e.param) from None


def _bias(bias: dict[str, Any] | None) -> dict[int, float]:
    """logit_bias with int token ids, as SamplingParams reads it (a key that is not one: a 400 naming the field)."""
    try:
        return logit_bias_ids(bias) or {}
    except ValueError as e:
        raise bad_request(str(e), "logit_bias") from None


def _usage_options(req: Any) -> dict[str, bool]:
    """stream_options -> (usage after the stream, running usage in every chunk). As vLLM, running usage
    (`continuous_usage_stats`) is sent only when `include_usage` is set too."""
    opts = req.stream_options
    include = bool(opts and opts.include_usage)
    return {"include_usage": include, "continuous_usage": include and bool(opts.continuous_usage_stats)}


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def _message_bytes(message: dict[str, Any]) -> int:
    content = message.get("content")
    if isinstance(content, list):
        return sum(_utf8_len(part.get("text", "")) for part in content)
    return _utf8_len(content) if isinstance(content, str) else 0
