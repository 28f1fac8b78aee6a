"""OpenAI serving: a validated request -> prompts + SamplingParams -> JSON or an SSE stream (stages 1, 10).

Owns: everything between the pydantic request and the TokenizerManager — the checks OpenAI makes
(model name, unsupported options, n / seed / stop_token_ids against this engine's limits, prompt/context
lengths against the scheduler's own ruler), the chat template, the mapping onto SamplingParams (its
ValueError names the field -> 400), the response and stream-chunk assembly (choices numbered
prompt-major, `n` per prompt; usage; logprobs in the completions and the chat formats), and what happens
when a client goes away: a streaming request is aborted when its generator is closed, a non-streaming
one when the disconnect wins the race against its result. Every check runs before the first byte of a
200 is sent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from dsaserve.common.sampling_params import MAX_N, SamplingParams
from dsaserve.server.hf_tokenizer import ChatTemplateError
from dsaserve.server.protocol import (
    APIError,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
    bad_request,
)
from dsaserve.server.tokenizer_manager import Handle, Prompt, TokenizerManager

MAX_CHOICES = MAX_N  # prompts x n of one request
MAX_SEED = (1 << 63) - 1  # seeds are signed 64-bit (torch.Generator.manual_seed, the IPC's msgpack ints)
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, it only shows in logs

Disconnected = Callable[[], Awaitable[None]]  # returns when the client has gone away


def sse(obj: Any) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def chunk_sse(model: Any) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, model_name: str, aliases: tuple[str, ...] = ()) -> None:
        self.tm = tm
        self.model_name = model_name
        self.names = {model_name, *aliases}

    # ---- shared checks ------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(404, f"model: {name!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    @staticmethod
    def _common_unsupported(req: Any) -> None:
        if req.logit_bias:
            raise bad_request("logit_bias: not supported by this server", "logit_bias")
        if req.stream_options is not None and not req.stream:
            raise bad_request("stream_options: only allowed when stream is true", "stream_options")

    @staticmethod
    def sampling(req: Any, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = [req.stop] if isinstance(req.stop, str) else req.stop
        values = {
            "n": req.n, "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "min_p": req.min_p, "seed": req.seed, "repetition_penalty": req.repetition_penalty,
            "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
            "max_tokens": max_tokens, "min_tokens": req.min_tokens, "stop": stop,
            "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos, "logprobs": logprobs,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens,
        }
        keep_none = {"max_tokens", "logprobs", "seed"}  # None means something for these
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None or k in keep_none})
        except ValueError as e:
            param = str(e).split(":", 1)[0]
            raise bad_request(str(e), param if param.isidentifier() else None) from None

    def _check_engine_limits(self, req: Any) -> None:
        """Limits of this engine, checked before any tokenisation (and so before a stream's 200): n per
        prompt within max_running_requests, seed + i of sample i still a signed 64-bit seed, and every
        stop token id inside the model's vocabulary (the sampler indexes the logits with it)."""
        self.tm.check_n(req.n)
        if req.seed is not None and req.seed + req.n - 1 > MAX_SEED:
            raise bad_request(f"seed: with n={req.n}, sample i draws with seed + i, and seed {req.seed} + "
                              f"{req.n - 1} exceeds the largest seed {MAX_SEED}", "seed")
        if req.stop_token_ids:
            self.tm.check_ids(req.stop_token_ids, "stop_token_ids", allow_empty=True)

    def _check_prompts(self, prompts: list[Prompt], max_tokens: int | None, param: str) -> None:
        for p in prompts:
            self.tm.check_ids(p.ids, param)
            self.tm.check_lengths(len(p.ids), max_tokens, param)

    # ---- /v1/completions ----------------------------------------------------------------------
    async def completion_prompts(self, prompt: Any) -> list[Prompt]:
        if isinstance(prompt, str):
            return [await self.tm.encode_text(prompt, "prompt")]
        if not prompt:
            raise bad_request("prompt: must not be empty", "prompt")
        if isinstance(prompt[0], str):
            return [await self.tm.encode_text(p, "prompt") for p in prompt]
        if isinstance(prompt[0], int):
            return [Prompt(list(prompt))]
        return [Prompt(list(p)) for p in prompt]

    async def completions(self, req: CompletionRequest, disconnected: Disconnected) -> Response:
        self.check_model(req.model)
        self._common_unsupported(req)
        if req.suffix:
            raise bad_request("suffix: not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of: only best_of == n is supported", "best_of")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo: prompt logprobs are not supported; use echo without logprobs", "echo")
        batch = 1 if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)) else len(req.prompt)
        if batch * req.n > MAX_CHOICES:  # before any tokenisation
            raise bad_request(f"n: {batch} prompts x n={req.n} is more than {MAX_CHOICES} choices", "n")
        self._check_engine_limits(req)
        prompts = await self.completion_prompts(req.prompt)
        self._check_prompts(prompts, req.max_tokens, "prompt")
        sampling = self.sampling(req, req.max_tokens, req.logprobs)
        self.tm.check_capacity(len(prompts) * req.n)
        h = await self.tm.submit(prompts, sampling, request_id=f"cmpl-{uuid.uuid4().hex}",
                                 logprobs=req.logprobs is not None)
        if req.echo:
            for p in prompts:
                p.text = p.text if p.text is not None else self.tm.tok.decode(p.ids, skip_special_tokens=False)
        if req.stream:
            return self._streaming(self._completion_stream(h, req, prompts), h)
        return await self._race(self._completion_full(h, req, prompts), h, disconnected)

    async def _completion_full(self, h: Handle, req: CompletionRequest, prompts: list[Prompt]) -> dict:
        n = req.n
        parts = [[prompts[c // n].text or ""] if req.echo else [] for c in range(len(prompts) * n)]
        sizes = [sum(map(len, p)) for p in parts]  # characters so far: the logprobs' text_offset
        lps = [CompletionLogprobs() if req.logprobs is not None else None for _ in parts]
        reasons: list[str | None] = [None] * len(parts)
        usage = _Usage(prompts, n)
        async for choice, item in self.tm.outputs(h):
            parts[choice].append(item["text"])
            _add_completion_logprobs(lps[choice], item, sizes[choice])
            sizes[choice] += len(item["text"])
            usage.add(choice, item)
            if item["finished"]:
                reasons[choice] = item["reason"]
        choices = [CompletionChoice(index=i, text="".join(p), logprobs=lps[i], finish_reason=reasons[i])
                   for i, p in enumerate(parts)]
        return CompletionResponse(id=h.id, model=self.model_name, choices=choices,
                                  usage=usage.info()).model_dump(exclude_none=True)

    def _completion_stream(self, h: Handle, req: CompletionRequest, prompts: list[Prompt]) -> AsyncIterator[str]:
        created, n = int(time.time()), req.n
        usage = _Usage(prompts, n)
        offsets = [0] * (len(prompts) * n)

        def chunk(choice: int, text: str, lp: Any = None, reason: str | None = None, u: Any = None) -> str:
            choices = [] if choice < 0 else [CompletionChoice(index=choice, text=text, logprobs=lp,
                                                              finish_reason=reason)]
            return chunk_sse(CompletionResponse(id=h.id, created=created, model=self.model_name,
                                                choices=choices, usage=u))

        async def body() -> AsyncIterator[str]:
            if req.echo:
                for c in range(len(offsets)):
                    offsets[c] = len(prompts[c // n].text or "")
                    yield chunk(c, prompts[c // n].text or "")
            async for choice, item in self.tm.outputs(h):
                usage.add(choice, item)
                lp = CompletionLogprobs() if req.logprobs is not None else None
                _add_completion_logprobs(lp, item, offsets[choice])
                offsets[choice] += len(item["text"])
                if item["text"] or item["finished"] or (lp and lp.tokens):
                    yield chunk(choice, item["text"], lp, item["reason"] if item["finished"] else None)
            if req.stream_options and req.stream_options.include_usage:
                yield chunk(-1, "", u=usage.info())

        return self._sse_body(body(), h)

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def chat_prompt(self, req: ChatCompletionRequest) -> Prompt:
        if req.add_generation_prompt and req.continue_final_message:
            raise bad_request("continue_final_message: cannot be combined with add_generation_prompt",
                              "continue_final_message")
        messages = []
        for m in req.messages:
            d = m.model_dump(exclude_none=True)
            d["role"] = "system" if d["role"] == "developer" else d["role"]  # templates know 'system'
            messages.append(d)
        extra = dict(req.chat_template_kwargs or {})
        clash = sorted(set(extra) & {"messages", "add_generation_prompt", "continue_final_message"})
        if clash:
            raise bad_request(f"chat_template_kwargs: {clash[0]!r} is a request field, set it there",
                              "chat_template_kwargs")
        try:
            text = self.tm.tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                                   continue_final_message=req.continue_final_message, **extra)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from None
        ids = await self.tm.encode(text, add_special_tokens=False)  # the template already has BOS etc.
        if not ids:
            raise bad_request("messages: the chat template rendered an empty prompt", "messages")
        return Prompt(ids, text)

    async def chat(self, req: ChatCompletionRequest, disconnected: Disconnected) -> Response:
        self.check_model(req.model)
        self._common_unsupported(req)
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request(f"response_format: {req.response_format.type!r} is not supported yet (text only)",
                              "response_format")
        if req.tools:
            raise bad_request("tools: tool calling is not supported by this server", "tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs: requires logprobs to be true", "top_logprobs")
        self._check_engine_limits(req)
        prompt = await self.chat_prompt(req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self._check_prompts([prompt], max_tokens, "messages")
        sampling = self.sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        self.tm.check_capacity(req.n)
        h = await self.tm.submit([prompt], sampling, request_id=f"chatcmpl-{uuid.uuid4().hex}",
                                 logprobs=req.logprobs)
        if req.stream:
            return self._streaming(self._chat_stream(h, req, prompt), h)
        return await self._race(self._chat_full(h, req, prompt), h, disconnected)

    async def _chat_full(self, h: Handle, req: ChatCompletionRequest, prompt: Prompt) -> dict:
        parts: list[list[str]] = [[] for _ in range(req.n)]
        lps = [ChatLogprobs(content=[]) if req.logprobs else None for _ in parts]
        reasons: list[str | None] = [None] * req.n
        usage = _Usage([prompt], req.n)
        async for choice, item in self.tm.outputs(h):
            parts[choice].append(item["text"])
            if lps[choice] is not None and item["lps"]:
                lps[choice].content.extend(_chat_logprobs(item["lps"]))
            usage.add(choice, item)
            if item["finished"]:
                reasons[choice] = item["reason"]
        choices = [ChatChoice(index=i, message=ChatMessageOut(content="".join(p)), logprobs=lps[i],
                              finish_reason=reasons[i]) for i, p in enumerate(parts)]
        return ChatCompletionResponse(id=h.id, model=self.model_name, choices=choices,
                                      usage=usage.info()).model_dump(exclude_none=True)

    def _chat_stream(self, h: Handle, req: ChatCompletionRequest, prompt: Prompt) -> AsyncIterator[str]:
        created = int(time.time())
        usage = _Usage([prompt], req.n)

        def chunk(choices: list[ChatChunkChoice], u: Any = None) -> str:
            return chunk_sse(ChatCompletionChunk(id=h.id, created=created, model=self.model_name,
                                                 choices=choices, usage=u))

        async def body() -> AsyncIterator[str]:
            for c in range(req.n):  # OpenAI's first chunk of each choice carries the role
                yield chunk([ChatChunkChoice(index=c, delta=DeltaMessage(role="assistant", content=""))])
            async for choice, item in self.tm.outputs(h):
                usage.add(choice, item)
                lp = ChatLogprobs(content=_chat_logprobs(item["lps"])) if req.logprobs and item["lps"] else None
                if item["text"] or item["finished"] or lp:
                    reason = item["reason"] if item["finished"] else None
                    delta = DeltaMessage(content=item["text"] or None)
                    yield chunk([ChatChunkChoice(index=choice, delta=delta, logprobs=lp, finish_reason=reason)])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage.info())

        return self._sse_body(body(), h)

    # ---- delivery -----------------------------------------------------------------------------
    async def _sse_body(self, body: AsyncIterator[str], h: Handle) -> AsyncIterator[str]:
        """SSE framing: errors after the 200 become an `error` event; always ends with [DONE]; closing
        the generator early (client gone) aborts the request."""
        try:
            async for part in body:
                yield part
        except APIError as e:
            yield sse(e.body())
        finally:
            await self.tm.abort(h)
        yield sse("[DONE]")

    def _streaming(self, body: AsyncIterator[str], h: Handle) -> Response:
        # the background task runs after the response, also when the client went away mid-stream
        return StreamingResponse(body, media_type="text/event-stream", background=BackgroundTask(self.tm.abort, h),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _race(self, result: Awaitable[dict], h: Handle, disconnected: Disconnected) -> Response:
        """A non-streaming result, unless the client disconnects first (then the request is aborted)."""
        work = asyncio.ensure_future(result)
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client is gone (or this handler was cancelled): stop the request
                work.cancel()
                await self.tm.abort(h)
            elif work.cancelled() or work.exception() is not None:  # failed: stop what still runs of it
                await self.tm.abort(h)
        if not work.done() or work.cancelled():
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(work.result())  # raises the APIError of a failed engine


class _Usage:
    """Token counts of one request: the prompt once per prompt, completion tokens per choice."""

    def __init__(self, prompts: list[Prompt], n: int) -> None:
        self.n = n
        self.prompt_tokens = sum(len(p.ids) for p in prompts)
        self.completion = [0] * (len(prompts) * n)
        self.cached = [0] * len(prompts)

    def add(self, choice: int, item: dict[str, Any]) -> None:
        self.completion[choice] = max(self.completion[choice], int(item.get("completion_tokens", 0)))
        p = choice // self.n
        self.cached[p] = max(self.cached[p], int(item.get("cached_tokens", 0) or 0))

    def info(self) -> UsageInfo:
        done = sum(self.completion)
        return UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=done,
                         total_tokens=self.prompt_tokens + done,
                         prompt_tokens_details={"cached_tokens": sum(self.cached)})


def _add_completion_logprobs(lp: CompletionLogprobs | None, item: dict[str, Any], offset: int) -> None:
    if lp is None or not item.get("lps"):
        return
    for e in item["lps"]:
        lp.tokens.append(e["token"])
        lp.token_logprobs.append(e["logprob"])
        lp.top_logprobs.append({t[0]: t[1] for t in e["top"]})
        lp.text_offset.append(offset)
        offset += len(e["token"])


def _chat_logprobs(entries: list[dict[str, Any]] | None) -> list[TokenLogprob]:
    out = []
    for e in entries or []:
        top = [TopLogprob(token=t[0], logprob=t[1], bytes=t[2]) for t in e["top"]]
        out.append(TokenLogprob(token=e["token"], logprob=e["logprob"], bytes=e["bytes"], top_logprobs=top))
    return out
