"""OpenAI serving: a pydantic request -> GenerateRequest -> JSON or an SSE stream (request path stages 1, 10).

Owns: the route handlers' one pass — the Processor validates and tokenizes the request into one
GenerateRequest, the TokenizerManager admits and submits it, and the results come back through
`Handle.results()` into the response and stream-chunk assembly (choices numbered prompt-major, `n` per
prompt; usage; logprobs in the completions and the chat formats; reasoning_content and tool_calls read
back per choice by server/chat_features.py, whole or as OpenAI deltas) — and what happens when a client goes
away: a streaming request is aborted when its generator is closed, a non-streaming one when the
disconnect wins the race against its result. Every check runs before the first byte of a 200 is sent;
an error after it (engine down, drain out of time) is a final SSE `error` event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from dsaserve.common.sampling_params import MAX_N
from dsaserve.server.chat_features import ChatPlan, ChatSettings, ChoiceOutput
from dsaserve.server.logprob_format import (
    PromptEntries,
    TextOffsets,
    add_completion_logprobs,
    add_prompt_logprobs,
    chat_logprobs,
    vllm_prompt_logprobs,
)
from dsaserve.server.processor import Processor
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
    PromptLogprobs,
    UsageInfo,
    bad_request,
)
from dsaserve.server.request_state import GenerateRequest, Handle, SampleOutput
from dsaserve.server.tokenizer_manager import TokenizerManager

MAX_CHOICES = MAX_N  # prompts x n of one request
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, it only shows in logs

Disconnected = Callable[[], Awaitable[None]]  # returns when the client has gone away


def sse(obj: Any) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


def chunk_sse(model: Any) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


class OpenAIServing:
    def __init__(self, tm: TokenizerManager, model_name: str, aliases: tuple[str, ...] = (),
                 chat: ChatSettings | None = None) -> None:
        self.tm = tm
        self.processor = Processor(tm.tok, lambda: tm.scheduler_info, chat, tm.check_grammar)
        self.model_name = model_name
        self.names = {model_name, *aliases}

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(404, f"model: {name!r} does not exist; this server serves {self.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")

    # ---- the one pass: request -> GenerateRequest -> Handle -> response -----------------------
    async def completions(self, req: CompletionRequest, disconnected: Disconnected) -> Response:
        self.check_model(req.model)
        batch = 1 if isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int)) else len(req.prompt)
        if batch * req.n > MAX_CHOICES:  # before any tokenisation
            raise bad_request(f"n: {batch} prompts x n={req.n} is more than {MAX_CHOICES} choices", "n")
        greq = await self.processor.completion(req)
        return await self._serve(greq, disconnected, self._completion_full, self._completion_stream)

    async def chat(self, req: ChatCompletionRequest, disconnected: Disconnected) -> Response:
        self.check_model(req.model)
        greq = await self.processor.chat(req)
        return await self._serve(greq, disconnected, self._chat_full, self._chat_stream)

    async def _serve(self, req: GenerateRequest, disconnected: Disconnected, full: Callable[[Handle], Any],
                     stream: Callable[[Handle], AsyncIterator[str]]) -> Response:
        self.tm.check_capacity(req)
        h = await self.tm.submit(req)
        if req.stream:
            return self._streaming(stream(h), h)
        return await self._race(full(h), h, disconnected)

    # ---- /v1/completions ----------------------------------------------------------------------
    async def _completion_full(self, h: Handle) -> dict:
        req = h.req
        texts = [[req.prompts[c // req.n].text or ""] if req.echo else [] for c in range(req.num_samples)]
        offsets = [TextOffsets(sum(map(len, t))) for t in texts]
        lps = [CompletionLogprobs() if req.logprobs else None for _ in texts]
        reasons: list[str | None] = [None] * len(texts)
        prompt_lps: list[Any] = [None] * len(texts)
        async for out in h.results():
            if out.prompt_lps is not None:  # the choice's first output: echo's entries go ahead of its own
                prompt_lps[out.choice] = _prompt_logprobs(req, out, lps[out.choice])
            texts[out.choice].append(out.text)
            add_completion_logprobs(lps[out.choice], out, offsets[out.choice])
            reasons[out.choice] = out.reason or reasons[out.choice]
        choices = [CompletionChoice(index=i, text="".join(t), logprobs=lps[i], finish_reason=reasons[i],
                                    prompt_logprobs=prompt_lps[i]) for i, t in enumerate(texts)]
        return CompletionResponse(id=h.id, model=self.model_name, choices=choices,
                                  usage=h.usage.info()).model_dump(exclude_none=True)

    def _completion_stream(self, h: Handle) -> AsyncIterator[str]:
        req, created = h.req, int(time.time())
        offsets = [TextOffsets(0) for _ in range(req.num_samples)]

        def chunk(choice: int, text: str, lp: Any = None, reason: str | None = None, u: Any = None,
                  plp: Any = None) -> str:
            choices = [] if choice < 0 else [CompletionChoice(index=choice, text=text, logprobs=lp,
                                                              finish_reason=reason, prompt_logprobs=plp)]
            return chunk_sse(CompletionResponse(id=h.id, created=created, model=self.model_name,
                                                choices=choices, usage=u or _running_usage(h)))

        def echo(c: int) -> str:
            return req.prompts[c // req.n].text or ""

        unechoed = set(range(len(offsets))) if req.echo else set()  # with logprobs: until the prompt's entries

        async def body() -> AsyncIterator[str]:
            for c in sorted(unechoed):
                offsets[c] = TextOffsets(len(echo(c)))
                if not req.logprobs:
                    unechoed.discard(c)
                    yield chunk(c, echo(c))
            async for out in h.results():
                lp, plp = CompletionLogprobs() if req.logprobs else None, None
                if out.prompt_lps is not None:
                    plp = _prompt_logprobs(req, out, lp)
                if out.choice in unechoed:  # its entries, or an end before them (an abort mid-prompt): no entries
                    unechoed.discard(out.choice)
                    yield chunk(out.choice, echo(out.choice), lp if out.prompt_lps is not None else None, plp=plp)
                    lp, plp = CompletionLogprobs(), None
                add_completion_logprobs(lp, out, offsets[out.choice])
                if _worth_a_chunk(h, out, bool(lp and lp.tokens)) or plp is not None:
                    yield chunk(out.choice, out.text, lp, out.reason, plp=plp)
            if req.include_usage:
                yield chunk(-1, "", u=h.usage.info())

        return self._sse_body(body(), h)

    # ---- /v1/chat/completions -----------------------------------------------------------------
    async def _chat_full(self, h: Handle) -> dict:
        n = h.req.n
        texts: list[list[str]] = [[] for _ in range(n)]
        lps = [ChatLogprobs(content=[]) if h.req.logprobs else None for _ in texts]
        reasons: list[str | None] = [None] * n
        prompt_lps = None
        async for out in h.results():
            texts[out.choice].append(out.text)
            if lps[out.choice] is not None and out.lps:
                lps[out.choice].content.extend(chat_logprobs(out.lps))
            reasons[out.choice] = out.reason or reasons[out.choice]
            if out.prompt_lps is not None and h.req.prompt_logprobs is not None:
                prompt_lps = vllm_prompt_logprobs(PromptEntries.from_wire(out.prompt_lps), h.req.prompt_logprobs)
        readers = [_reader(h) for _ in range(n)]  # reasoning / tool calls split off the text
        choices = [ChatChoice(index=i, message=ChatMessageOut(**readers[i].whole("".join(t))), logprobs=lps[i],
                              finish_reason=readers[i].finish_reason(reasons[i])) for i, t in enumerate(texts)]
        return ChatCompletionResponse(id=h.id, model=self.model_name, choices=choices, usage=h.usage.info(),
                                      prompt_logprobs=prompt_lps).model_dump(exclude_none=True)

    def _chat_stream(self, h: Handle) -> AsyncIterator[str]:
        req, created = h.req, int(time.time())

        def chunk(choices: list[ChatChunkChoice], u: Any = None, plp: Any = None) -> str:
            return chunk_sse(ChatCompletionChunk(id=h.id, created=created, model=self.model_name,
                                                 choices=choices, usage=u or _running_usage(h), prompt_logprobs=plp))

        readers = [_reader(h) for _ in range(req.n)]

        async def body() -> AsyncIterator[str]:
            for c in range(req.n):  # OpenAI's first chunk of each choice carries the role
                yield chunk([ChatChunkChoice(index=c, delta=DeltaMessage(role="assistant", content=""))])
            async for out in h.results():
                lp = ChatLogprobs(content=chat_logprobs(out.lps)) if req.logprobs and out.lps else None
                plp = None  # vLLM's prompt_logprobs: on the chunk of the first output
                if out.prompt_lps is not None and req.prompt_logprobs is not None and out.choice == 0:
                    plp = vllm_prompt_logprobs(PromptEntries.from_wire(out.prompt_lps), req.prompt_logprobs)
                reader = readers[out.choice]
                fields = reader.feed(out.text, final=out.finished)  # content / reasoning_content / tool_calls
                # buffered text (a tool call being read) is not worth an empty delta, unless usage is timed
                if fields or out.finished or lp or plp or (h.req.continuous_usage and out.tokens):
                    reason = reader.finish_reason(out.reason) if out.finished else None
                    yield chunk([ChatChunkChoice(index=out.choice, delta=DeltaMessage(**fields), logprobs=lp,
                                                 finish_reason=reason)], plp=plp)
            if req.include_usage:
                yield chunk([], h.usage.info())

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


def _reader(h: Handle) -> ChoiceOutput:
    """How one choice's text is read back: the request's chat features, or plain content."""
    return h.req.chat.choice() if h.req.chat is not None else ChoiceOutput(ChatPlan(), None, False, False)
def _running_usage(h: Handle) -> UsageInfo | None:
    """stream_options.continuous_usage_stats: every chunk carries the request's usage so far (vLLM's
    behaviour). Counts are request-wide (all choices), so they only grow and a chunk's tokens are the growth
    of completion_tokens; for n=1 this is vLLM's per-choice count."""
    return h.usage.info() if h.req.continuous_usage else None


def _prompt_logprobs(req: GenerateRequest, out: SampleOutput, lp: CompletionLogprobs | None) -> PromptLogprobs | None:
    """A choice's prompt entries: into `lp` where echo asked for logprobs (ahead of the completion's); returned in
    vLLM's shape where the request asked prompt_logprobs."""
    entries = PromptEntries.from_wire(out.prompt_lps)
    if req.echo and lp is not None:
        add_prompt_logprobs(lp, entries, req.sampling.logprobs or 0)
    return vllm_prompt_logprobs(entries, req.prompt_logprobs) if req.prompt_logprobs is not None else None


def _worth_a_chunk(h: Handle, out: SampleOutput, has_logprobs: bool) -> bool:
    """An output is streamed when it has text, ends its choice, or carries logprobs; with running usage also
    whenever it carries tokens, so that a client can time every token even when its text is empty."""
    return bool(out.text or out.finished or has_logprobs or (h.req.continuous_usage and out.tokens))
