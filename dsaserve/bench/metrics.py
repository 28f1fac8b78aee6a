"""Serving metrics from recorded timestamps (pure functions, no I/O).

Owns: `Record` (what the client saw of one request: when each token-carrying chunk arrived and how many
tokens it carried, the server's usage counts, the end of the stream, or the error) and the metric
definitions, those of vLLM's `benchmark_serving`:

  TTFT  arrival of the first chunk that carries a token, from the request's send time.
  E2EL  end of the stream ([DONE]) from the send time.
  TPOT  (E2EL - TTFT) / (output tokens - 1), per request with more than one output token.
  ITL   one value per output token after the first chunk: a chunk that arrives g after the previous one and
        carries k tokens gives k gaps of g / k (each token an equal share of its chunk's wait). With one
        token per chunk this is the gap between tokens; the ITLs of a request sum to (last chunk - TTFT).

Output tokens are the server's `usage.completion_tokens`; a request fails only on an error (HTTP status,
an error event, an exception), never because its tokens decoded to no text.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class Record:
    input_len: int = 0  # prompt tokens: the server's usage when it sent one, else what the client asked for
    expected_output: int = 0  # max_tokens asked for
    ok: bool = False
    error: str = ""
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (seconds since send, tokens in the chunk)
    output_tokens: int = 0  # the server's usage.completion_tokens (else the chunks' sum)
    e2el: float = 0.0
    counted_by_text: bool = False  # some chunk had no token count (no logprobs / usage): counted as 1 token
    empty_text_chunks: int = 0  # token-carrying chunks whose text was empty (partial UTF-8, special tokens)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] if self.chunks else None

    @property
    def tpot(self) -> float | None:
        return tpot(self.ttft, self.e2el, self.output_tokens)

    @property
    def itls(self) -> list[float]:
        return itls(self.chunks)

    @property
    def chunk_tokens(self) -> int:
        return sum(k for _, k in self.chunks)


def tpot(ttft: float | None, e2el: float, output_tokens: int) -> float | None:
    if ttft is None or output_tokens < 2:
        return None
    return (e2el - ttft) / (output_tokens - 1)


def itls(chunks: list[tuple[float, int]]) -> list[float]:
    out: list[float] = []
    for (t0, _), (t1, k) in zip(chunks, chunks[1:], strict=False):
        out += [(t1 - t0) / k] * k
    return out


def percentile(values: list[float], p: float) -> float:
    """numpy's default ('linear'): the value at rank p/100 * (n - 1), interpolated between neighbours."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * p / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def stats(name: str, values: list[float], pcts: list[float]) -> dict[str, float]:
    """mean / median / std / pN of seconds, as milliseconds under vLLM's keys (mean_ttft_ms, p99_ttft_ms, ...)."""
    ms = [v * 1000.0 for v in values]
    out = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
           f"median_{name}_ms": percentile(ms, 50.0),
           f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0}
    out.update({f"p{p:g}_{name}_ms": percentile(ms, p) for p in pcts})
    return out


def metric_values(records: list[Record]) -> dict[str, list[float]]:
    ok = [r for r in records if r.ok]
    return {
        "ttft": [t for r in ok if (t := r.ttft) is not None],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [x for r in ok for x in r.itls],
        "e2el": [r.e2el for r in ok],
    }


def summarize(records: list[Record], duration: float, pcts: list[float]) -> dict[str, Any]:
    """Every number of a run, under vLLM's result keys, plus the per-request lists."""
    ok = [r for r in records if r.ok]
    n_in, n_out = sum(r.input_len for r in ok), sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: 0.0)
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(records) - len(ok), "duration": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": per_s(len(ok)), "output_throughput": per_s(n_out),
        "total_token_throughput": per_s(n_in + n_out),
        "requests_counted_by_text": sum(r.counted_by_text for r in ok),
        "requests_short_of_max_tokens": sum(r.output_tokens < r.expected_output for r in ok),
        "empty_text_chunks": sum(r.empty_text_chunks for r in ok),
    }
    for name, values in metric_values(records).items():
        out.update(stats(name, values, pcts))
    out.update({
        "input_lens": [r.input_len for r in records], "max_tokens": [r.expected_output for r in records],
        "output_lens": [r.output_tokens for r in records],
        "ttfts": [r.ttft for r in records], "tpots": [r.tpot for r in records], "e2els": [r.e2el for r in records],
        "itls": [r.itls for r in records], "errors": [r.error for r in records],
    })
    return out
