"""The logprob shapes of the responses: OpenAI's completions format (tokens, token_logprobs, top_logprobs,
text_offset; with echo the prompt's tokens first), OpenAI's chat format (content entries with bytes and
top_logprobs) and vLLM's prompt_logprobs ({token id: {logprob, rank, decoded_token}} per prompt token), from
the detokenizer's entries (server/detokenizer_process.py: logprob_entries, prompt_entries).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from dsaserve.server import ipc
from dsaserve.server.protocol import CompletionLogprobs, PromptLogprobs, TokenLogprob, TopLogprob
from dsaserve.server.request_state import SampleOutput


class TextOffsets:
    """Each completion token's text_offset: the characters its bytes add to the text, counted by a UTF-8 decoder
    as the detokenizer's text has them (a byte-fallback token adds part of a character, or a replacement
    character; its display string `bytes:\\xNN` is longer than that). Not the text sent so far, which lags
    while a stop string's possible start is held back."""

    def __init__(self, start: int) -> None:
        self.at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def take(self, token_bytes: bytes | list[int]) -> int:
        raw = bytes(token_bytes)
        pending = self._decoder.getstate()[0]
        # an unfinished character before a token that does not continue it ends as replacement characters
        # ahead of this token's own text
        flushed = len(pending.decode("utf-8", "replace")) if pending and raw and not 0x80 <= raw[0] < 0xC0 else 0
        at = self.at + flushed
        self.at += len(self._decoder.decode(raw))
        return at


def add_completion_logprobs(lp: CompletionLogprobs | None, out: SampleOutput, offsets: TextOffsets) -> None:
    if lp is None or not out.lps:
        return
    for e in out.lps:
        lp.tokens.append(e["token"])
        lp.token_logprobs.append(e["logprob"])
        lp.top_logprobs.append({t[0]: t[1] for t in e["top"]})
        lp.text_offset.append(offsets.take(e["bytes"]))


def chat_logprobs(entries: list[dict[str, Any]] | None) -> list[TokenLogprob]:
    out = []
    for e in entries or []:
        top = [TopLogprob(token=t[0], logprob=t[1], bytes=t[2]) for t in e["top"]]
        out.append(TokenLogprob(token=e["token"], logprob=e["logprob"], bytes=e["bytes"], top_logprobs=top))
    return out


@dataclass(frozen=True)
class PromptEntries:
    """A prompt's entries as the detokenizer sends them, in columns (detokenizer_process.prompt_entries): per
    prompt token its id, bytes, logprob and rank (None for the first token: nothing comes before it) and its
    alternatives, most likely first; `text`, each id's text."""

    ids: list[int]
    raw: list[bytes]
    logprob: list[float | None]
    rank: list[int | None]
    starts: list[int]  # token i's alternatives are top_ids[starts[i]:starts[i + 1]], their logprobs top_lps'
    top_ids: list[int]
    top_lps: list[float]
    text: dict[int, str]

    @classmethod
    def from_wire(cls, d: dict[str, Any]) -> PromptEntries:
        return cls(d["ids"], d["bytes"], d["logprob"], d["rank"], list(accumulate(d["top_len"], initial=0)),
                   ipc.unpack_ints(d["top_ids"]), ipc.unpack_floats(d["top_lps"]),
                   dict(zip(d["vocab"], d["text"], strict=True)))

    def top(self, i: int, k: int) -> Iterator[tuple[int, float]]:
        """(id, logprob) of token i's first k alternatives: the request's k (the engine's lists have the largest
        k any of its requests asked)."""
        a = self.starts[i]
        b = min(self.starts[i + 1], a + k)
        return zip(self.top_ids[a:b], self.top_lps[a:b], strict=True)


def add_prompt_logprobs(lp: CompletionLogprobs, e: PromptEntries, k: int) -> None:
    """Echo with logprobs: the prompt's tokens ahead of the completion's, their top-k alternatives; the first
    token has no logprob (nothing comes before it), as OpenAI's legacy echo."""
    offsets = TextOffsets(0)
    for i, tid in enumerate(e.ids):
        lp.tokens.append(e.text[tid])
        lp.token_logprobs.append(e.logprob[i])
        lp.top_logprobs.append(None if e.logprob[i] is None else {e.text[t]: v for t, v in e.top(i, k)})
        lp.text_offset.append(offsets.take(e.raw[i]))


def vllm_prompt_logprobs(e: PromptEntries, k: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token None (the first) or the token itself and its top-k alternatives,
    keyed by token id, each with its logprob, rank (1 = most likely) and text."""
    out: PromptLogprobs = []
    for i, tid in enumerate(e.ids):
        if e.logprob[i] is None:
            out.append(None)
            continue
        d = {str(tid): {"logprob": e.logprob[i], "rank": e.rank[i], "decoded_token": e.text[tid]}}
        for rank, (t, v) in enumerate(e.top(i, k), start=1):
            d.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": e.text[t]})
        out.append(d)
    return out
