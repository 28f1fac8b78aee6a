"""DeepSeek-V3.2 tool calls (DSML), as its published encoding writes them (request path stage 10):

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

Owns: the region parser of that format. `string="true"` values are text, `string="false"` values JSON (when
they are not JSON they are kept as text, never an error). Names as in vLLM (`deepseek_v32`) and SGLang
(`deepseekv32`).
"""

from __future__ import annotations

import json
import re

from dsaserve.server.tool_parsers.base import ParsedCall, ToolParser

DSML = "｜DSML｜"
CALLS_START, CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
INVOKE_END = f"</{DSML}invoke>"
_INVOKE = re.compile(rf'<{DSML}invoke\s+name="([^"]*)"\s*>')
_PARAM = re.compile(rf'<{DSML}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>(.*?)</{DSML}parameter>',
                    re.DOTALL)


class DeepSeekV32ToolParser(ToolParser):
    start = CALLS_START

    def _parse_region(self, text: str, i: int) -> tuple[list[ParsedCall], int | None]:
        body, j = self.region_body(text, i, CALLS_START, CALLS_END)
        calls, pos = [], 0
        while (m := _INVOKE.search(body, pos)) is not None:
            end = body.find(INVOKE_END, m.end())
            inner = body[m.end():] if end < 0 else body[m.end():end]
            call = ParsedCall(m.group(1).strip(), closed=end >= 0)
            call.args = [(k, self._value(call.name, k, v, s)) for k, s, v in _PARAM.findall(inner)]
            calls.append(call)
            if end < 0:
                break
            pos = end + len(INVOKE_END)
        if j >= 0 and not calls:
            calls.append(ParsedCall("", closed=True))  # an empty block: malformed
        return calls, None if j < 0 else j + len(CALLS_END)

    def _value(self, function: str | None, key: str, raw: str, string: str) -> str:
        if string == "true":
            return json.dumps(raw, ensure_ascii=False)
        if string == "false":
            try:
                return json.dumps(json.loads(raw), ensure_ascii=False)
            except (ValueError, RecursionError):
                return json.dumps(raw, ensure_ascii=False)
        return self.value_json(function, key, raw)
