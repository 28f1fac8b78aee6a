"""Request state in the main process: the one internal request object and its in-flight state (stages 1-2, 10).

Owns: `GenerateRequest`, what one HTTP request becomes after validation and tokenisation (vLLM's
`EngineCoreRequest`): its prompts as token ids, one SamplingParams, what the client asked to get back
(logprobs, echo, usage in the stream), and the KV pages its samples can hold at most (admission's
measure). `Handle`, one request in flight: its engine sub-requests (one per prompt, `n` samples each,
choices numbered prompt-major), the asyncio queue the receive loop puts its outputs on, per-sample
timings for the metrics, and its usage. `Handle.results()` is the one place outputs are read back: typed
`SampleOutput`s, with usage counted as they pass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.incremental_detokenizer import PROMPT_CONTEXT
from dsaserve.server.protocol import APIError, UsageInfo


@dataclass
class Prompt:
    ids: list[int]
    text: str | None = None  # for echo


@dataclass
class GenerateRequest:
    """One validated, tokenized HTTP request: everything the TokenizerManager and the renderers need."""

    id: str
    prompts: list[Prompt]
    sampling: SamplingParams
    max_tokens: int  # resolved: what is left of the context when the client gave none
    logprobs: bool = False  # return logprob entries with the outputs
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: running usage in every chunk
    echo: bool = False
    prompt_logprobs: int | None = None  # vLLM's field as asked (echo's entries come from SamplingParams' too)
    internal: bool = False  # the health probe: no metrics, not counted against the queue bound
    chat: Any = None  # chat_features.ChatReadback: how to read tool calls / reasoning back (chat only)

    @property
    def n(self) -> int:
        return self.sampling.n

    @property
    def num_samples(self) -> int:
        return len(self.prompts) * self.sampling.n

    def pages_per_sample(self, page_size: int) -> list[int]:
        """KV pages each sample holds at most (prompt + max_tokens): admission's measure of the pool."""
        return [-(-(len(p.ids) + self.max_tokens) // page_size) for p in self.prompts for _ in range(self.n)]

    def engine_requests(self) -> list[tuple[str, dict[str, Any]]]:
        """(rid, GENERATE message fields) per prompt: what crosses into the scheduler process."""
        s = self.sampling
        detok = {"stop": list(s.stop), "include_stop_str_in_output": s.include_stop_str_in_output,
                 "skip_special_tokens": s.skip_special_tokens, "logprobs": self.logprobs}
        sampling = s.to_dict()
        return [(f"{self.id}-{i}", {"input_ids": p.ids, "sampling": sampling,
                                    "detok": {"prompt_tail": p.ids[-PROMPT_CONTEXT:], **detok,
                                              **({"prompt_ids": p.ids} if s.prompt_logprobs is not None else {})}})
                for i, p in enumerate(self.prompts)]


@dataclass
class SampleTiming:
    first: float | None = None  # monotonic time of the first output token
    last: float | None = None
    tokens: int = 0


@dataclass(frozen=True)
class SampleOutput:
    """One output of one choice, as the detokenizer sent it."""

    choice: int
    text: str
    lps: list[dict[str, Any]] | None
    finished: bool
    reason: str | None
    tokens: int = 0  # token ids this output carries (its text may be empty: a partial UTF-8 character)
    prompt_lps: dict[str, Any] | None = None  # the prompt's entries as columns, on the choice's first output
    # (detokenizer_process.prompt_entries; logprob_format.PromptEntries.from_wire reads them)

    @classmethod
    def from_item(cls, choice: int, item: dict[str, Any]) -> SampleOutput:
        return cls(choice, item["text"], item.get("lps"), bool(item["finished"]),
                   item["reason"] if item["finished"] else None, len(item.get("ids") or ()), item.get("plps"))


class Usage:
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


@dataclass
class Handle:
    """One request in flight: its engine sub-requests and the queue their outputs arrive on."""

    req: GenerateRequest
    arrival: float = field(default_factory=time.monotonic)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    subs: dict[str, tuple[int, int]] = field(default_factory=dict)  # rid -> (first choice index, prompt tokens)
    open_samples: set[tuple[str, int]] = field(default_factory=set)
    timing: dict[tuple[str, int], SampleTiming] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.usage = Usage(self.req.prompts, self.req.n)

    @property
    def id(self) -> str:
        return self.req.id

    @property
    def internal(self) -> bool:
        return self.req.internal

    def register(self, rid: str, prompt_index: int) -> None:
        n = self.req.n
        self.subs[rid] = (prompt_index * n, len(self.req.prompts[prompt_index].ids))
        for i in range(n):
            self.open_samples.add((rid, i))
            self.timing[(rid, i)] = SampleTiming()

    def choice(self, rid: str, index: int) -> int:
        return self.subs[rid][0] + index

    def close_sub(self, rid: str) -> None:
        self.open_samples = {s for s in self.open_samples if s[0] != rid}

    async def results(self) -> AsyncIterator[SampleOutput]:
        """Every output until each sample finished, usage counted on the way; APIError if the engine failed."""
        while self.open_samples or not self.queue.empty():
            got = await self.queue.get()
            if isinstance(got, APIError):
                raise got
            choice, item = got
            self.usage.add(choice, item)
            yield SampleOutput.from_item(choice, item)
