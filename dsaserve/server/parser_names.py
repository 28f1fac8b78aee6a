"""The names `--reasoning-parser` and `--tool-call-parser` accept, apart from the parsers themselves.

Owns: the two lists of CLI choices. The parsers' modules (server/reasoning_parsers.py, server/tool_parsers/)
take their names from here, and tests/server/test_parser_names.py holds the registries to these lists.

Why: `dsaserve serve` validates its flags (server/server_args.py) before it spawns the ranks, so whatever
that imports runs before the rank's first instruction; the parsers bring the chat encodings and the HF
tokenizer wrapper with them (~0.15 s of imports on the critical path of every start, issue 16).
"""

from __future__ import annotations

REASONING_PARSERS = ("glm45", "deepseek_v3", "deepseek-v3", "deepseek_r1")
REASONING_PARSER_CHOICES = ("auto", "none", *REASONING_PARSERS)
TOOL_PARSER_NAMES = ("glm45", "glm47", "glm5", "deepseek_v32", "deepseekv32")
TOOL_PARSER_CHOICES = ("auto", "none", *TOOL_PARSER_NAMES)
