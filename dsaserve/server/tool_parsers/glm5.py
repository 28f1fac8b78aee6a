"""GLM-4.5 / 4.7 / 5 tool calls: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>`.

Owns: the region parser of that format (request path stage 10). GLM-4.5 puts a newline after the name and
between pairs, GLM-4.7/5 write them back to back; both are accepted. A value is raw text: a `string`
parameter keeps it as is, others are JSON (ToolParser.value_json). Names as in vLLM (`glm45`, `glm47`) and
SGLang (`glm45`, `glm47`).
"""

from __future__ import annotations

import re

from dsaserve.server.tool_parsers.base import ParsedCall, ToolParser

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
ARG_KEY, ARG_VALUE = "<arg_key>", "<arg_value>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm5ToolParser(ToolParser):
    start = TOOL_CALL_START

    def _parse_region(self, text: str, i: int) -> tuple[list[ParsedCall], int | None]:
        body, j = self.region_body(text, i, TOOL_CALL_START, TOOL_CALL_END)
        cut = min((k for k in (body.find(ARG_KEY), body.find("\n")) if k >= 0), default=-1)
        if cut < 0 and j < 0:
            return [ParsedCall(None)], None  # the name may still grow
        name = (body if cut < 0 else body[:cut]).strip()
        call = ParsedCall(name or None, closed=j >= 0)
        call.args = [(k.strip(), self.value_json(name, k.strip(), v)) for k, v in _PAIR.findall(body)]
        if j >= 0 and call.name is None:
            call.name = ""  # closed without a name: malformed
        return [call], None if j < 0 else j + len(TOOL_CALL_END)
