"""Tool-call parsing shared by every family: model text -> (content, tool calls), whole or streamed.

Owns: the parse model every format maps onto (a tool-call *region* opened by a start marker, holding
calls that each have a name and complete key/value arguments), the conversion of a raw argument value to
JSON (by the function's JSON schema: a `string` parameter stays text, anything else is parsed as JSON and
kept as text when it is not JSON), the never-raise contract (any failure returns the text as content),
and `ToolCallStream`, which turns text deltas into OpenAI `delta.tool_calls` entries (request path
stage 10, after the detokenizer).

Streaming works by re-scanning the open region on each delta and emitting only what is new: a call's
header (index, id, name) once its name is complete, then its arguments as a JSON text that only grows:
`{"k1": v1` -> `, "k2": v2` -> `}` when the call closes. Text that may be the start of a marker (and
trailing whitespace before one) is held back, so a marker split across deltas never leaks into content.
A format subclass implements only `_parse_region`.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedCall:
    """One call as far as the text goes: `name` None until complete, `args` the complete pairs."""

    name: str | None
    args: list[tuple[str, str]] = field(default_factory=list)  # (key, JSON text of the value)
    closed: bool = False


@dataclass
class ParsedOutput:
    content: str
    tool_calls: list[ToolCall]


@dataclass
class _Scan:
    content: str
    calls: list[ParsedCall]
    open_at: int | None  # where an unclosed region starts (its raw text), None if every region closed
    hold: int = 0  # chars at the end of `content` that may still become part of a marker
    open_calls: int = 0  # how many of `calls` (the last ones) belong to the unclosed region

    @property
    def closed_calls(self) -> list[ParsedCall]:
        return self.calls[: len(self.calls) - self.open_calls]


def args_json(args: list[tuple[str, str]], closed: bool) -> str:
    body = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in args)
    return body + "}" if closed else body


class ToolParser:
    """Base: subclasses set `start` (the marker opening a region) and implement `_parse_region`."""

    start = ""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.schemas: dict[str, dict[str, Any]] = {}
        for t in tools or []:
            fn = t.get("function") if isinstance(t, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                self.schemas[fn["name"]] = params if isinstance(params, dict) else {}

    # ---- format hook ------------------------------------------------------------------------
    def _parse_region(self, text: str, i: int) -> tuple[list[ParsedCall], int | None]:
        """Calls of the region starting at text[i] (the start marker); end index, or None if unclosed."""
        raise NotImplementedError

    @staticmethod
    def region_body(text: str, i: int, start: str, end: str) -> tuple[str, int]:
        """The text of the region opened by `start` at text[i], up to `end` (or the end of text), and where
        `end` is (-1 while the region is open)."""
        j = text.find(end, i + len(start))
        return (text[i + len(start):] if j < 0 else text[i + len(start):j]), j

    # ---- values -----------------------------------------------------------------------------
    def value_json(self, function: str | None, key: str, raw: str) -> str:
        """A raw argument value as JSON text, by the parameter's schema type."""
        prop = ((self.schemas.get(function or "") or {}).get("properties") or {}).get(key)
        types = prop.get("type") if isinstance(prop, dict) else None
        types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
        if types and all(t == "string" for t in types):
            return json.dumps(raw, ensure_ascii=False)
        try:
            return json.dumps(json.loads(raw), ensure_ascii=False)
        except (ValueError, RecursionError):
            return json.dumps(raw, ensure_ascii=False)

    # ---- scanning ---------------------------------------------------------------------------
    def scan(self, text: str) -> _Scan:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            i = text.find(self.start, pos)
            if i < 0:
                tail = text[pos:]
                content.append(tail)
                return _Scan("".join(content), calls, None, _held_back(tail, self.start))
            content.append(text[pos:i].rstrip() if i > pos else "")
            region, end = self._parse_region(text, i)
            calls.extend(region)
            if end is None:
                return _Scan("".join(content), calls, i, 0, len(region))
            pos = end

    def parse(self, text: str) -> ParsedOutput:
        """The whole output: complete calls, everything else as content. Never raises: a malformed call
        (no name) makes the whole text content; a truncated region stays in the content as text."""
        try:
            s = self.scan(text)
            done = s.closed_calls
            if any(not c.name for c in done) or not done:
                return ParsedOutput(text if s.calls or s.open_at is not None else s.content, [])
            content = s.content + (text[s.open_at:] if s.open_at is not None else "")
            return ParsedOutput(content, [ToolCall(c.name or "", args_json(c.args, True)) for c in done])
        except Exception:  # a parser bug must never fail the request: the text is still the answer
            log.exception("tool parser %s failed; returning the text as content", type(self).__name__)
            return ParsedOutput(text, [])

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)


def _held_back(tail: str, marker: str) -> int:
    """How many chars at the end of tail could begin `marker` (plus whitespace before it)."""
    keep = 0
    for k in range(min(len(marker) - 1, len(tail)), 0, -1):
        if marker.startswith(tail[-k:]):
            keep = k
            break
    rest = tail[: len(tail) - keep]
    return keep + (len(rest) - len(rest.rstrip()))


@dataclass
class ToolDelta:
    """What one text delta adds: content text and OpenAI `tool_calls` delta entries."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallStream:
    """Text deltas in -> ToolDelta out; `finish()` flushes what was held back."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.calls: list[ToolCall] = []  # headers sent, in order
        self.args_sent: list[str] = []
        self.failed = False

    def feed(self, delta: str) -> ToolDelta:
        self.text += delta
        if self.failed:
            return ToolDelta(content=delta)
        try:
            return self._diff(self.parser.scan(self.text), final=False)
        except Exception:
            log.exception("tool parser %s failed mid-stream; the rest is content", type(self.parser).__name__)
            self.failed = True
            return ToolDelta(content=self.text[self.content_sent:] if not self.calls else delta)

    def finish(self) -> ToolDelta:
        if self.failed:
            return ToolDelta()
        try:
            return self._diff(self.parser.scan(self.text), final=True)
        except Exception:
            log.exception("tool parser %s failed at the end", type(self.parser).__name__)
            return ToolDelta()

    def _diff(self, s: _Scan, final: bool) -> ToolDelta:
        out = ToolDelta()
        content = s.content if final else s.content[: len(s.content) - s.hold]
        calls = s.calls
        if final and s.open_at is not None and len(self.calls) <= len(s.closed_calls):
            # truncated, and nothing of it was sent: it is text
            content = self.text if not s.closed_calls else content + self.text[s.open_at:]
            calls = s.closed_calls
        if len(content) > self.content_sent:
            out.content = content[self.content_sent:]
            self.content_sent = len(content)
        for idx, call in enumerate(calls):
            if not call.name:
                break
            if idx == len(self.calls):
                tc = ToolCall(call.name, "")
                self.calls.append(tc)
                self.args_sent.append("")
                out.tool_calls.append({"index": idx, "id": tc.id, "type": "function",
                                       "function": {"name": call.name, "arguments": ""}})
            args = args_json(call.args, call.closed or final)
            if len(args) > len(self.args_sent[idx]) and args.startswith(self.args_sent[idx]):
                out.tool_calls.append({"index": idx, "function": {"arguments": args[len(self.args_sent[idx]):]}})
                self.args_sent[idx] = self.calls[idx].arguments = args
        return out
