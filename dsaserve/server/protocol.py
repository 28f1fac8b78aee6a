"""OpenAI wire protocol: request/response models and OpenAI-style error objects (request path stage 1).

Owns: the pydantic models of `/v1/completions` and `/v1/chat/completions` (requests validated strictly:
unknown top-level fields are rejected, `extra="forbid"`, and a null is the field's default; OpenAI's fields
that change no output here, such as `store`, are accepted; a few vLLM/SGLang sampling extensions such as `top_k`
are declared explicitly), the response and stream-chunk models, and
`APIError`, the one exception every bad input becomes: `{"error": {"message", "type", "param", "code"}}`
with an HTTP status. Messages are capped (`MAX_ERROR_CHARS`) so a small bad body never produces a huge
error. Value ranges that SamplingParams also checks (temperature, top_p, n, ...) are checked here too so
the error names the OpenAI field before any tokenisation; SamplingParams stays the last word.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, model_validator

from dsaserve.common.sampling_params import MAX_LOGPROBS, MAX_N

MAX_ERROR_CHARS = 512  # an error message never exceeds this many characters
MAX_STOP = 4  # OpenAI: "up to 4 sequences where the API will stop generating"
MAX_COMPLETION_LOGPROBS = 5  # OpenAI legacy completions: logprobs is at most 5

Number = StrictInt | StrictFloat
Temperature = Annotated[Number, Field(ge=0.0, le=2.0)]  # OpenAI's documented range
TopP = Annotated[Number, Field(gt=0.0, le=1.0)]
Penalty = Annotated[Number, Field(ge=-2.0, le=2.0)]
NChoices = Annotated[StrictInt, Field(ge=1, le=MAX_N)]
MAX_INT = (1 << 31) - 1  # bound on count-like integers: anything larger is nonsense and would not fit IPC ints
MaxTokens = Annotated[StrictInt, Field(ge=1, le=MAX_INT)]
Stop = StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP)] | None


# ---- errors ---------------------------------------------------------------------------------------
class APIError(Exception):
    """One bad input or server condition, rendered as an OpenAI error object with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = cap(message)
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def cap(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 15] + " ...(truncated)"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unavailable(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, "service_unavailable")


def internal(message: str) -> APIError:
    return APIError(500, message, "internal_error", None, "internal_error")


def validation_error(exc: Any) -> APIError:
    """The first pydantic error as `param: message`; a value that fits no member of a union lists them."""
    try:
        errs = list(exc.errors(include_url=False, include_input=False))  # pydantic: leave the input out
    except TypeError:  # FastAPI's RequestValidationError.errors() takes no arguments
        errs = list(exc.errors())
    first = errs[0] if errs else {"loc": (), "msg": str(exc), "type": ""}
    loc = tuple(first.get("loc", ()))
    branch = next((i for i, x in enumerate(loc) if _is_union_branch(x)), None)
    param = ".".join(str(x) for x in (loc if branch is None else loc[:branch]) if x != "body") or None
    if branch is not None:  # pydantic tried every member of a union
        group = [e for e in errs if tuple(e.get("loc", ()))[:branch] == loc[:branch] and len(e["loc"]) > branch]
        # a member of the right type that broke a constraint (range, length) says the most
        constraint = next((e for e in group if not e["type"].endswith("_type") and len(e["loc"]) == branch + 1),
                          None)
        if constraint is not None:
            return bad_request(f"{param}: {constraint['msg']}", param)
        members = dict.fromkeys(str(e["loc"][branch]) for e in group)
        return bad_request(f"{param}: expected one of {', '.join(members)}", param)
    msg = "unrecognized request argument" if first.get("type") == "extra_forbidden" else first.get("msg", "invalid")
    extra = f" (and {len(errs) - 1} more errors)" if len(errs) > 1 else ""
    return bad_request(f"{param}: {msg}{extra}" if param else f"{msg}{extra}", param)


def _is_union_branch(x: Any) -> bool:
    # pydantic puts the tried union member ("str", "list[str]", "function-after[...]") into the location
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "none") or "[" in x)


# ---- requests -------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    _null_means_none: ClassVar[frozenset[str]] = frozenset()  # fields whose null is not their default

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """OpenAI types its optional fields as nullable: a null means the default (clients send unset fields as
        null). A required field's null stays an error, and a field in `_null_means_none` keeps its null."""
        if not isinstance(data, dict):
            return data
        dropped = {k for k, f in cls.model_fields.items() if not f.is_required()} - cls._null_means_none
        return {k: v for k, v in data.items() if v is not None or k not in dropped}


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _SamplingFields(_Strict):
    """Fields both endpoints share; the extensions after `user` are vLLM's names."""

    model: StrictStr
    n: NChoices = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop = None
    seed: Annotated[StrictInt, Field(ge=-(1 << 63), lt=1 << 63)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    logit_bias: dict[StrictStr, Annotated[Number, Field(ge=-100, le=100)]] | None = None  # OpenAI's range
    # extensions (vLLM / SGLang)
    top_k: Annotated[StrictInt, Field(ge=-1, le=MAX_INT)] | None = None
    min_p: Annotated[Number, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0.0)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0, le=MAX_INT)] | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0, le=MAX_INT)]] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # structured output (server/chat_features.py): vLLM's structured_outputs and its older guided_* names,
    # SGLang's regex / ebnf; at most one of them (or response_format) per request
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    regex: StrictStr | None = None
    ebnf: StrictStr | None = None
    # vLLM's: each prompt token's logprob, rank and this many alternatives (engine/prompt_logprobs.py)
    prompt_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    # max_tokens unset is OpenAI's 16; null is what the context leaves (vLLM's reading)
    _null_means_none: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]  # ids checked against the vocab
    max_tokens: MaxTokens | None = 16  # OpenAI's default for legacy completions
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None
    echo: StrictBool = False
    best_of: Annotated[StrictInt, Field(ge=1, le=MAX_N)] | None = None
    suffix: StrictStr | None = None
    response_format: ResponseFormat | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message. Extra keys (tool_calls, reasoning_content, ...) are kept: templates may read them."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (chat_encoding parses them)
    tool_call_id: StrictStr | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":  # an assistant turn may be tool calls alone
            raise ValueError(f"a {self.role} message needs content")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: MaxTokens | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    # OpenAI fields that change no output here (storage, billing, latency hints): accepted and ignored, as vLLM
    # does; reasoning_effort goes to the chat template (server/chat_features.py), modalities may only ask for text
    store: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    service_tier: StrictStr | None = None
    prediction: dict[str, Any] | None = None
    prompt_cache_key: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    reasoning_effort: StrictStr | None = None  # OpenAI's levels grow ("none" ... "xhigh"): passed as given
    modalities: list[Literal["text"]] | None = None
    # extensions (vLLM)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None


# ---- responses ------------------------------------------------------------------------------------
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


# vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}, the
# prompt token and the top alternatives
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM / SGLang / DeepSeek API: the <think> part
    tool_calls: list[dict[str, Any]] | None = None  # [{id, type: function, function: {name, arguments}}]


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # [{index, id?, type?, function: {name?, arguments}}]


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # on the chunk of the first output, where asked


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dsaserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
