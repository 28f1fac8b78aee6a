"""Tool-call parsers by name (`--tool-call-parser`, vLLM's and SGLang's names), and by model family.

Owns: the registry. `auto` (the default) picks the checkpoint family's parser from config.json's
model_type; `none` turns tool calling off (requests with `tools` then get a 400).
"""

from __future__ import annotations

from dsaserve.server.parser_names import TOOL_PARSER_CHOICES
from dsaserve.server.tool_parsers.base import ParsedOutput, ToolCall, ToolCallStream, ToolDelta, ToolParser
from dsaserve.server.tool_parsers.deepseek_v32 import DeepSeekV32ToolParser
from dsaserve.server.tool_parsers.glm5 import Glm5ToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "glm45": Glm5ToolParser, "glm47": Glm5ToolParser, "glm5": Glm5ToolParser,
    "deepseek_v32": DeepSeekV32ToolParser, "deepseekv32": DeepSeekV32ToolParser,
}
FAMILY_TOOL_PARSER = {"glm_moe_dsa": "glm47", "deepseek_v32": "deepseek_v32"}


def resolve_tool_parser(name: str | None, model_type: str | None) -> str | None:
    """The registry name `--tool-call-parser NAME` means for this model (None: tool calling off)."""
    if name in (None, "auto"):
        return FAMILY_TOOL_PARSER.get(model_type or "")
    if name == "none":
        return None
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: {name!r} is not one of {', '.join(TOOL_PARSER_CHOICES)}")
    return name


__all__ = ["TOOL_PARSERS", "TOOL_PARSER_CHOICES", "ParsedOutput", "ToolCall", "ToolCallStream", "ToolDelta",
           "ToolParser", "resolve_tool_parser", "DeepSeekV32ToolParser", "Glm5ToolParser"]
