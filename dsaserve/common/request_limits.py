"""RequestLimits: the one ruler a request is measured with against the running engine (request path stages 1
and 3: the HTTP door and the scheduler's admission).

Owns: the checks that depend on the engine rather than on the request alone — token ids inside the
vocabulary (the prompt's, and stop_token_ids: the sampler indexes the logits with them), the prompt against
`max_req_input_len`, prompt + max_tokens against the context, n against `--max-running-requests` — and
their error, `LimitError` (a ValueError) naming the request field, with the OpenAI error code where there is
one. The scheduler holds one (`engine/scheduler.py`); the HTTP processor builds the same from the scheduler's
`scheduler_info` (`server/processor.py`), so no request HTTP accepts is failed later in prefill. What a
request's own values allow (ranges, seed + n) is SamplingParams' validation. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's error code for both length checks


class LimitError(ValueError):
    """`field: message`; `field` is the request field to name (the HTTP error's param), `code` its error code."""

    def __init__(self, field: str, message: str, code: str | None = None) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.code = field, code


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int  # 0: token ids are not range-checked (a runner without a vocabulary, in tests)
    max_req_input_len: int
    max_seq_len: int  # the context: prompt + output tokens
    max_running_requests: int  # 0: unbounded

    @classmethod
    def from_info(cls, info: Mapping[str, Any], vocab_size: int | None = None) -> RequestLimits:
        """From `scheduler_info` (max_model_len there is already the scheduler's max_seq_len)."""
        limit = int(info["max_req_input_len"])
        context = min(int(info.get("max_model_len") or limit + 1), int(info.get("max_total_tokens") or 1 << 62))
        return cls(int(vocab_size or info.get("vocab_size") or 0), limit, context,
                   int(info.get("max_running_requests") or 0))

    def check_ids(self, ids: Iterable[Any], field: str, allow_empty: bool = False) -> None:
        ids = list(ids)
        if not ids and not allow_empty:
            raise LimitError(field, "the prompt is empty")
        vocab = self.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab and t >= vocab):
                raise LimitError(field, f"token id {t!r} is outside the vocabulary [0, {vocab})")

    def check_lengths(self, prompt_len: int, max_tokens: int | None, field: str, tokens_field: str = "max_tokens",
                      min_tokens: int = 0) -> int:
        """The prompt within max_req_input_len, prompt + max_tokens (named `tokens_field` in errors) within the
        context, and min_tokens within what is left of it; returns the max_tokens to use (None: what is left)."""
        if prompt_len > self.max_req_input_len:
            raise LimitError(field, f"the prompt has {prompt_len} tokens, more than max_req_input_len = "
                             f"{self.max_req_input_len}", CONTEXT_LENGTH_EXCEEDED)
        left = self.max_seq_len - prompt_len
        if max_tokens is not None and max_tokens > left:
            raise LimitError(tokens_field, f"the prompt ({prompt_len} tokens) plus {tokens_field} ({max_tokens}) "
                             f"exceeds the context limit of {self.max_seq_len} tokens", CONTEXT_LENGTH_EXCEEDED)
        if min_tokens > left:
            raise LimitError("min_tokens", f"{min_tokens} is more than the {left} tokens the context leaves after "
                             f"the prompt ({prompt_len} tokens)", CONTEXT_LENGTH_EXCEEDED)
        return left if max_tokens is None else max_tokens

    def check_n(self, n: int) -> None:
        if self.max_running_requests and n > self.max_running_requests:
            raise LimitError("n", f"{n} samples exceed --max-running-requests of {self.max_running_requests}")

    def check(self, prompt: Any, n: int, max_tokens: int | None, stop_token_ids: Iterable[int],
              bias_ids: Iterable[int] = (), min_tokens: int = 0, field: str = "prompt_token_ids") -> None:
        """Every check, as the scheduler admits a request (`bias_ids`: logit_bias's token ids)."""
        if not isinstance(prompt, (list, tuple)):
            raise LimitError(field, f"must be a list of token ids, got {type(prompt).__name__}")
        self.check_ids(prompt, field)
        self.check_ids(stop_token_ids, "stop_token_ids", allow_empty=True)
        self.check_ids(bias_ids, "logit_bias", allow_empty=True)
        self.check_lengths(len(prompt), max_tokens, field, min_tokens=min_tokens)
        self.check_n(n)
