"""Reasoning split for both families, thinking on (the prompt opened <think>) and off, whole and streamed."""

from __future__ import annotations

import random

import pytest

from dsaserve.server.reasoning_parsers import ReasoningParser, resolve_reasoning_parser

CASES = [  # (thinking, output, reasoning, content)
    (True, "Let me think.\nok</think>\n\nThe answer is 4.", "Let me think.\nok", "The answer is 4."),
    (True, "still thinking, cut off by max_tokens", "still thinking, cut off by max_tokens", None),
    (True, "</think>Direct.", "", "Direct."),
    (False, "The answer is 4.", None, "The answer is 4."),
    (False, "<think>model opened it</think>then content", "model opened it", "then content"),
    (False, "a </think> in plain text", None, "a </think> in plain text"),
    (True, "<think>doubled</think>x", "doubled", "x"),
]


@pytest.mark.parametrize("thinking,text,reasoning,content", CASES)
def test_whole_output_splits(thinking, text, reasoning, content):
    assert ReasoningParser(thinking).parse(text) == (reasoning, content)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("thinking,text,reasoning,content", CASES)
def test_streamed_split_equals_the_whole_split(thinking, text, reasoning, content, seed):
    rng = random.Random(seed)
    p = ReasoningParser(thinking)
    r, c, pos = "", "", 0
    while pos < len(text):
        step = rng.randint(1, 5)
        d = p.feed(text[pos:pos + step])
        r, c, pos = r + d.reasoning, c + d.content, pos + step
    d = p.feed("", final=True)
    r, c = r + d.reasoning, c + d.content
    assert r == (reasoning or "")
    assert c == (content or "")


def test_parser_names():
    assert resolve_reasoning_parser(None, "glm_moe_dsa") is None  # off unless asked, as in vLLM
    assert resolve_reasoning_parser("auto", "deepseek_v32") == "deepseek_v3"
    assert resolve_reasoning_parser("glm45", None) == "glm45"
    with pytest.raises(ValueError, match="--reasoning-parser"):
        resolve_reasoning_parser("qwen3", None)
