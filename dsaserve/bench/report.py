"""The summary table of `bench serve`, in vLLM's `benchmark_serving` format, and the JSON file.

Owns: `table_rows` (label, JSON key, format of every line), so the table prints exactly the JSON's
numbers (rounded to the format), and `parse_table` for the tests that hold them to it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

WIDTH = 50
SECTIONS = (("ttft", "TTFT", "Time to First Token"),
            ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
            ("itl", "ITL", "Inter-token Latency"),
            ("e2el", "E2EL", "End-to-end Latency"))
Row = tuple[str, str, str]  # (label, key, format); a label of "" makes a section rule from the key


def table_rows(s: dict[str, Any], pcts: list[float]) -> list[Row]:
    rows: list[Row] = [("Successful requests:", "completed", "d"), ("Failed requests:", "failed", "d")]
    if s.get("max_concurrency") is not None:
        rows.append(("Maximum request concurrency:", "max_concurrency", "d"))
    if s.get("request_rate") is not None:
        rows.append(("Request rate configured (RPS):", "request_rate", ".2f"))
    rows += [("Benchmark duration (s):", "duration", ".2f"),
             ("Total input tokens:", "total_input_tokens", "d"),
             ("Total generated tokens:", "total_output_tokens", "d"),
             ("Request throughput (req/s):", "request_throughput", ".2f"),
             ("Output token throughput (tok/s):", "output_throughput", ".2f"),
             ("Total Token throughput (tok/s):", "total_token_throughput", ".2f")]
    for key, short, title in SECTIONS:
        rows.append(("", title, "-"))
        rows += [(f"Mean {short} (ms):", f"mean_{key}_ms", ".2f"), (f"Median {short} (ms):", f"median_{key}_ms", ".2f")]
        rows += [(f"P{p:g} {short} (ms):", f"p{p:g}_{key}_ms", ".2f") for p in pcts]
    return rows


def format_table(s: dict[str, Any], pcts: list[float], title: str = "Serving Benchmark Result") -> str:
    lines = [f" {title} ".center(WIDTH, "=")]
    for label, key, fmt in table_rows(s, pcts):
        if not label:
            lines.append(key.center(WIDTH, fmt))
        else:
            lines.append(f"{label:<40} {format(s[key], fmt):<10}")
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def parse_table(text: str) -> dict[str, float]:
    """label -> number of every `label: number` line of a printed table."""
    out = {}
    for line in text.splitlines():
        label, sep, rest = line.partition(":")
        if sep and rest.strip():
            try:
                out[label + ":"] = float(rest)
            except ValueError:
                continue
    return out


def warnings(s: dict[str, Any]) -> list[str]:
    out = []
    if s.get("requests_counted_by_text"):
        out.append(f"{s['requests_counted_by_text']} requests had chunks without a token count (no logprobs or "
                   "per-chunk usage from the server): those chunks counted as one token each, ITL is per chunk")
    if s.get("requests_short_of_max_tokens"):
        out.append(f"{s['requests_short_of_max_tokens']} requests ended before max_tokens (EOS or a stop; "
                   "--ignore-eos makes output lengths as asked)")
    errors = sorted({e for e in s.get("errors", []) if e})
    out += [f"error: {e}" for e in errors[:5]]
    return out


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    """Strict JSON (an infinite request rate is written as the string "inf")."""
    Path(path).write_text(json.dumps(_finite(report), indent=2, default=str, allow_nan=False) + "\n")


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
