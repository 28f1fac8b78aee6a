"""server/parser_names.py: the CLI's choices are the parsers' registries (kept apart so `dsaserve serve`
validates its flags without importing the parsers before it spawns the ranks)."""

from __future__ import annotations

import subprocess
import sys

from dsaserve.server import parser_names, reasoning_parsers, tool_parsers


def test_the_choices_are_the_registries():
    assert tuple(tool_parsers.TOOL_PARSERS) == parser_names.TOOL_PARSER_NAMES
    assert ("auto", "none", *tool_parsers.TOOL_PARSERS) == tool_parsers.TOOL_PARSER_CHOICES
    assert ("auto", "none", *reasoning_parsers.REASONING_PARSERS) == reasoning_parsers.REASONING_PARSER_CHOICES
    for name in parser_names.REASONING_PARSERS:
        assert reasoning_parsers.resolve_reasoning_parser(name, None) == name
    for name in parser_names.TOOL_PARSER_NAMES:
        assert tool_parsers.resolve_tool_parser(name, None) == name


def test_server_args_imports_no_parser():
    code = ("import sys; import dsaserve.server.server_args; "
            "print(sorted(m for m in sys.modules if 'parsers' in m or 'chat_encoding' in m or 'hf_tokenizer' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
