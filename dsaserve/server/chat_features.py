"""Tools, tool_choice, reasoning and structured output of one chat request (request path stages 1 and 10).

Owns: the request side — `plan_chat` turns `tools` / `tool_choice` / `parallel_tool_calls` /
`response_format` / vLLM's `structured_outputs` (and its older `guided_*`, SGLang's `regex` / `ebnf`) into a
`ChatPlan`: what the template renders, which grammar the sampler enforces (engine/grammar.py spec dict) and
how the output is read back — and the output side — `ChoiceOutput`, one per choice, which splits reasoning
(`--reasoning-parser`), parses tool calls (`--tool-call-parser`), whole or as OpenAI deltas.

tool_choice (OpenAI semantics, vLLM's enforcement):
  auto      the model decides; its native format (GLM `<tool_call>`, DeepSeek DSML) is parsed;
  none      no tool calls are parsed (tools are still rendered, as OpenAI documents);
  required  the grammar forces a JSON list of {"name", "parameters"} calls, each valid per its function's
            schema (one call when parallel_tool_calls is false);
  named     the grammar forces the named function's arguments object, valid per its schema.
With a reasoning parser on and the prompt opening `<think>`, the grammar starts after the `</think>` token
(vLLM's reasoning-aware structured output: the reasoning is free, the answer constrained); without one, a
request with a grammar is rendered with thinking off (both families' switch).
Errors are `ChatPlanError(message, param)`; the serving layer answers them with a 400.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from dsaserve.engine.grammar import GrammarError, make_spec
from dsaserve.server.chat_encoding import encoder_for
from dsaserve.server.reasoning_parsers import THINK_END, ReasoningParser, resolve_reasoning_parser
from dsaserve.server.tool_parsers import TOOL_PARSERS, ToolCall, ToolCallStream, resolve_tool_parser

# request fields naming a grammar, other than response_format: field -> spec kind
GRAMMAR_FIELDS = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "regex": "regex", "ebnf": "grammar"}
STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                   "json_object": "json_object"}  # vLLM's StructuredOutputsParams


class ChatPlanError(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ChatPlan:
    tools: list[dict[str, Any]] | None = None  # rendered by the template
    tool_mode: str = "none"  # none | auto | required | named
    function: str | None = None  # the named function
    parallel: bool = True
    grammar: dict[str, str] | None = None  # GrammarSpec.to_dict()
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    grammar_source: str | None = None  # the request field the grammar came from (the param of its 400)


def _spec(kind: str, value: Any, param: str) -> dict[str, str]:
    try:
        return make_spec(kind, value).to_dict()
    except GrammarError as e:
        raise ChatPlanError(f"{param}: {e}", param) from None


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise ChatPlanError(f"tools[{i}]: must be {{'type': 'function', 'function': {{'name': ...}}}}", "tools")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict):
            raise ChatPlanError(f"tools[{i}].function.parameters: must be a JSON schema object", "tools")
        out[fn["name"]] = params
    return out


def _tool_mode(choice: Any, functions: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if functions else "none"), None
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise ChatPlanError(f"tool_choice: {choice!r} is not one of auto, none, required", "tool_choice")
        if choice != "none" and not functions:
            raise ChatPlanError(f"tool_choice: {choice!r} needs `tools`", "tool_choice")
        return choice, None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ChatPlanError("tool_choice: a named choice is {'type': 'function', 'function': {'name': ...}}",
                            "tool_choice")
    if name not in functions:
        raise ChatPlanError(f"tool_choice: function {name!r} is not in `tools`", "tool_choice")
    return "named", name


def _required_schema(functions: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    calls = [{"type": "object", "properties": {"name": {"enum": [n]}, "parameters": p},
              "required": ["name", "parameters"]} for n, p in functions.items()]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": items}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def format_grammar(req: Any) -> tuple[str, dict[str, str]] | None:
    """(field, grammar) of response_format / structured_outputs / guided_* / regex / ebnf (at most one)."""
    found: list[tuple[str, dict[str, str]]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", _spec("json_object", None, "response_format")))
    elif rf is not None and rf.type == "json_schema":
        js = rf.json_schema or {}
        if not isinstance(js.get("schema"), (dict, bool)):
            raise ChatPlanError("response_format: json_schema needs a `schema` object", "response_format")
        found.append(("response_format", _spec("json_schema", js["schema"], "response_format")))
    so = getattr(req, "structured_outputs", None)
    if so:
        keys = [k for k in STRUCTURED_KEYS if so.get(k) not in (None, False)]
        if len(keys) != 1:
            raise ChatPlanError(f"structured_outputs: give exactly one of {', '.join(STRUCTURED_KEYS)}",
                                "structured_outputs")
        found.append(("structured_outputs", _spec(STRUCTURED_KEYS[keys[0]], so[keys[0]], "structured_outputs")))
    for name, kind in GRAMMAR_FIELDS.items():
        if getattr(req, name, None) is not None:
            found.append((name, _spec(kind, getattr(req, name), name)))
    if len(found) > 1:
        raise ChatPlanError(f"{found[1][0]}: only one of {found[0][0]} and {found[1][0]} may be set", found[1][0])
    return found[0] if found else None


def plan_chat(req: Any, tool_parser: str | None, reason_first: bool = False) -> ChatPlan:
    """The plan of a chat request; ChatPlanError (-> 400) for bad tools / choices / formats.

    `reason_first`: a reasoning parser is on and `</think>` is one token, so a grammar can wait for the
    reasoning to end (the Processor sets the spec's "after"); otherwise a grammar turns thinking off."""
    tools = getattr(req, "tools", None) or None
    functions = _functions(tools) if tools else {}
    mode, name = _tool_mode(getattr(req, "tool_choice", None), functions)
    if mode == "auto" and tool_parser is None:
        raise ChatPlanError("tools: tool calling is off on this server (--tool-call-parser none)", "tools")
    parallel = getattr(req, "parallel_tool_calls", None) is not False
    fmt = format_grammar(req)
    kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
    if getattr(req, "reasoning_effort", None) is not None:  # templates that know it read it (vLLM passes it too)
        kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    plan = ChatPlan(tools, mode, name, parallel, fmt[1] if fmt else None, kwargs, fmt[0] if fmt else None)
    if mode in ("required", "named") and plan.grammar is not None:
        raise ChatPlanError("tool_choice: a required or named tool choice cannot be combined with "
                            "response_format / structured_outputs", "tool_choice")
    if mode == "named":
        plan.grammar, plan.grammar_source = _spec("json_schema", functions[name], "tools"), "tools"
    elif mode == "required":
        plan.grammar = _spec("json_schema", _required_schema(functions, parallel), "tools")
        plan.grammar_source = "tools"
    if plan.grammar is not None and not reason_first:  # constrained from the first token: no reasoning
        plan.template_kwargs.update(enable_thinking=False, thinking=False)
    return plan


@dataclass(frozen=True)
class ChatSettings:
    """The server's side of chat features, built once: the family, its encoder, the parsers in force."""

    model_type: str | None
    encoder: Any  # server/chat_encoding ChatEncoder
    tool_parser: str | None  # registry name, None: tool calling off
    reasoning_parser: str | None  # None: reasoning stays in content
    think_end_id: int | None = None  # the `</think>` token, when it is one token

    @classmethod
    def build(cls, model_dir: str, tok: Any, tool_call_parser: str = "auto",
              reasoning_parser: str | None = None) -> ChatSettings:
        model_type = _model_type(model_dir)
        end = tok.encode(THINK_END, add_special_tokens=False)
        return cls(model_type, encoder_for(model_type, tok), resolve_tool_parser(tool_call_parser, model_type),
                   resolve_reasoning_parser(reasoning_parser, model_type), end[0] if len(end) == 1 else None)

    @property
    def reason_first(self) -> bool:
        """Grammars can wait for the reasoning to end (see plan_chat)."""
        return self.reasoning_parser is not None and self.think_end_id is not None

    def readback(self, plan: ChatPlan, thinking: bool) -> ChatReadback:
        return ChatReadback(plan, thinking, self.tool_parser, self.reasoning_parser is not None)


@dataclass(frozen=True)
class ChatReadback:
    """What reading a chat request's output back needs (rides on its GenerateRequest)."""

    plan: ChatPlan
    thinking: bool  # the prompt opened <think>
    tool_parser: str | None
    reasoning: bool

    def choice(self) -> ChoiceOutput:
        return ChoiceOutput(self.plan, self.tool_parser, self.reasoning, self.thinking)


def _model_type(model_dir: str) -> str | None:
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def merge_call_deltas(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per call index in a chunk, as OpenAI streams them: a call's header (id, type, name) and the
    arguments that follow it in the same delta become one entry, the arguments' pieces joined in order."""
    merged: dict[int, dict[str, Any]] = {}
    for c in calls:
        m = merged.get(c["index"])
        if m is None:
            merged[c["index"]] = {**c, "function": dict(c.get("function", {}))}
            continue
        for key in ("id", "type"):
            if key in c:
                m.setdefault(key, c[key])
        fn, new = m["function"], c.get("function", {})
        if "name" in new:
            fn.setdefault("name", new["name"])
        if "arguments" in new:
            fn["arguments"] = fn.get("arguments", "") + new["arguments"]
    return list(merged.values())


def _complete_items(text: str) -> list[Any]:
    """The whole items of a JSON list, also of one cut short by max_tokens (the grammar made it a list of calls):
    '[{...}, {"na' -> [{...}]."""
    decoder, i, items = json.JSONDecoder(), text.find("[") + 1, []
    if i == 0:
        return items
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:  # the list's end, or an item cut short
            return items
        items.append(item)


class ChoiceOutput:
    """One choice's text -> message fields (whole) or delta fields (streamed)."""

    def __init__(self, plan: ChatPlan, tool_parser: str | None, reasoning: bool, thinking: bool) -> None:
        self.plan = plan
        self.reasoning = ReasoningParser(thinking) if reasoning else None
        parser_cls = TOOL_PARSERS.get(tool_parser or "")
        self.parser = parser_cls(plan.tools) if plan.tool_mode == "auto" and parser_cls else None
        self.stream: ToolCallStream | None = self.parser.stream() if self.parser else None
        self.forced_text = ""
        self.forced_call: ToolCall | None = None
        self.num_calls = 0

    # ---- whole --------------------------------------------------------------------------------
    def whole(self, text: str) -> dict[str, Any]:
        reasoning, content = self.reasoning.parse(text) if self.reasoning else (None, text)
        calls: list[ToolCall] = []
        if self.plan.tool_mode in ("required", "named"):
            calls, content = self._forced_calls(content or ""), None
        elif self.parser is not None and content:
            parsed = self.parser.parse(content)
            calls, content = parsed.tool_calls, parsed.content or None
            if not self.plan.parallel:
                calls = calls[:1]
        self.num_calls = len(calls)
        out: dict[str, Any] = {"content": content}
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        if calls:
            out["tool_calls"] = [c.to_openai() for c in calls]
        return out

    def _forced_calls(self, text: str) -> list[ToolCall]:
        if self.plan.tool_mode == "named":  # nothing after the reasoning (cut short): no call
            return [ToolCall(self.plan.function or "", text)] if text else []
        try:
            return [ToolCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False))
                    for it in _complete_items(text)]
        except (TypeError, KeyError):
            return []

    def finish_reason(self, reason: str | None) -> str | None:
        """"tool_calls" where the model chose to call (auto, required); a named choice forced the call, so it
        stops with "stop", as OpenAI and vLLM report it."""
        forced = self.plan.tool_mode == "named"
        return "tool_calls" if self.num_calls and reason == "stop" and not forced else reason

    # ---- streamed -----------------------------------------------------------------------------
    def feed(self, text: str, final: bool = False) -> dict[str, Any]:
        """Delta fields for this text delta (`final`: the last one); only non-empty fields."""
        if self.reasoning is not None:
            d = self.reasoning.feed(text, final)
            reasoning, content = d.reasoning, d.content
        else:
            reasoning, content = "", text
        out: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
        if self.plan.tool_mode in ("required", "named"):
            calls = self._forced_deltas(content, final)
        elif self.stream is not None:
            td = self.stream.feed(content)
            if final:
                end = self.stream.finish()
                td.content += end.content
                td.tool_calls += end.tool_calls
            content = td.content
            calls = [c for c in td.tool_calls if self.plan.parallel or c["index"] == 0]
        else:
            calls = []
        if content and self.plan.tool_mode not in ("required", "named"):
            out["content"] = content
        if calls:
            out["tool_calls"] = merge_call_deltas(calls)
            self.num_calls = max(self.num_calls, 1 + max(c["index"] for c in calls))
        return out

    def _forced_deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """named: the arguments stream as they come; required: the calls when the JSON list is complete."""
        if self.plan.tool_mode == "named":
            out = []
            if self.forced_call is None and text:  # the header once the arguments start (after any reasoning)
                self.forced_call = ToolCall(self.plan.function or "", "")
                out.append({"index": 0, "id": self.forced_call.id, "type": "function",
                            "function": {"name": self.forced_call.name, "arguments": ""}})
            if text:
                out.append({"index": 0, "function": {"arguments": text}})
            return out
        self.forced_text += text
        if not final:
            return []
        out = []
        for i, c in enumerate(self._forced_calls(self.forced_text)):
            out.append({"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}})
            out.append({"index": i, "function": {"arguments": c.arguments}})
        return out
