"""Reasoning parsers: split `<think>...</think>` off the output into `reasoning_content` (stage 10).

Owns: `--reasoning-parser` (vLLM's / SGLang's names: `glm45`, `deepseek_v3`, `deepseek-v3`), the split of a
whole output and of a stream of text deltas. Both families write `<think>` / `</think>`; what differs is
who writes `<think>`: GLM-5 and DeepSeek-V3.2 put it at the end of the *prompt* when thinking is on (so
the output starts inside the reasoning) and `</think>` when it is off (the output is all content). A
model that writes `<think>` itself is handled too. An output that never closes its reasoning (truncated)
is all reasoning, as vLLM does. Never raises.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsaserve.server.chat_encoding.base import THINK_END, THINK_START
from dsaserve.server.parser_names import REASONING_PARSER_CHOICES, REASONING_PARSERS

FAMILY_REASONING_PARSER = {"glm_moe_dsa": "glm45", "deepseek_v32": "deepseek_v3"}


def resolve_reasoning_parser(name: str | None, model_type: str | None) -> str | None:
    """`--reasoning-parser NAME` for this model; None (the default, as in vLLM) keeps reasoning in content."""
    if name in (None, "none"):
        return None
    if name == "auto":
        return FAMILY_REASONING_PARSER.get(model_type or "")
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: {name!r} is not one of {', '.join(REASONING_PARSER_CHOICES)}")
    return name


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """One output. `thinking`: the prompt ended inside an open `<think>` (thinking mode on)."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def split(self, text: str, final: bool = True) -> tuple[str | None, str]:
        """(reasoning or None, content) of the text so far; before `final`, a possible partial marker at
        the end is left out of both."""
        stripped = text.lstrip()
        body, inside = text, self.thinking
        if stripped.startswith(THINK_START):
            body, inside = stripped[len(THINK_START):], True
        elif not final and stripped and THINK_START.startswith(stripped):
            return None, ""  # might still become "<think>"
        if not inside:
            return None, text
        end = body.find(THINK_END)
        if end < 0:
            return (body if final else body[: len(body) - _partial(body, THINK_END)]), ""
        return body[:end], body[end + len(THINK_END):].lstrip("\n")

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning_content, content) of a whole output; either may be None."""
        try:
            reasoning, content = self.split(text)
        except Exception:  # never fail the answer
            return None, text
        return reasoning, (content or None) if reasoning is not None else content

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        self.text += delta
        try:
            reasoning, content = self.split(self.text, final)
        except Exception:
            reasoning, content = None, self.text
        out = ReasoningDelta()
        if reasoning is not None and len(reasoning) > self.sent_reasoning:
            out.reasoning = reasoning[self.sent_reasoning:]
            self.sent_reasoning = len(reasoning)
        if len(content) > self.sent_content:
            out.content = content[self.sent_content:]
            self.sent_content = len(content)
        return out


def _partial(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
