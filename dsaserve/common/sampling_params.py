"""SamplingParams: what one request asks of the sampler and of the stop logic (request path stage 9/10).

Owns: the user-facing knobs with vLLM's names and defaults, their validation (errors name the field, so
the HTTP layer can put it into an OpenAI error's `param`), and a plain-dict form for msgpack IPC.
Pure Python: the server's main process builds these without torch.

Semantics (vLLM's where they exist):
  temperature 0 -> greedy; top_k 0 or -1 -> off; top_p 1 -> off; min_p 0 -> off.
  repetition_penalty acts on prompt + output tokens; frequency/presence penalties on output tokens only.
  seed -> a private generator per request: the same seed gives the same sample whatever else is batched
  (with n > 1, sample i uses seed + i).
  max_tokens None -> up to the context limit; min_tokens suppresses EOS and stop_token_ids until reached.
  logit_bias {token id: bias} -> added to those logits before everything else (OpenAI's, bias in [-100, 100]; -100
  bans a token, also under greedy); the logprobs stay the raw model's.
  logprobs k -> the sampled token's logprob plus the top-k alternatives, from the raw model distribution
  (before temperature / penalties / filters, as vLLM's default `raw_logprobs`); 0 -> only the sampled one.
  prompt_logprobs k -> each prompt token's logprob given the tokens before it (the first has none), its rank
  and the top-k alternatives, from the same raw distribution (vLLM's); such a request is served from the
  prefix cache only where its entries already exist (a cached position is never computed).
  structured_outputs -> only tokens its grammar allows are sampled (engine/grammar.py).
  stop strings are matched on detokenized text by whoever detokenizes (offline Engine / server); the
  core handles stop_token_ids, EOS, max_tokens, min_tokens, ignore_eos.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

MAX_LOGPROBS = 20  # OpenAI's top_logprobs bound; also vLLM's default --max-logprobs
MAX_STOP_STRINGS = 16
MAX_N = 128
MAX_SEED = (1 << 63) - 1  # seeds are signed 64-bit (torch.Generator.manual_seed, the IPC's msgpack ints)
_GREEDY_EPS = 1e-5  # vLLM: temperature below this is greedy (dividing by it would overflow)
MAX_LOGIT_BIAS = 100.0  # OpenAI: "values between -100 and 100"
MAX_LOGIT_BIAS_TOKENS = 1024  # entries a request may bias (bounds the IPC message and the sampler's scatter)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> bias (ids as ints; as strings over IPC)
    # structured output (vLLM's name): {"kind": json_schema | json_object | regex | choice | grammar, "value": text}
    # as engine/grammar.py's GrammarSpec.to_dict() writes it, plus optionally "after": a token id (the reasoning
    # end, `</think>`) before which the output is free; the sampler masks tokens by it
    structured_outputs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = logit_bias_ids(self.logit_bias)
        self.validate()

    # ---- validation ----------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        _int("n", self.n, lo=1, hi=MAX_N)
        _num("temperature", self.temperature, lo=0.0)
        _num("top_p", self.top_p, lo=0.0, hi=1.0)
        if self.top_p <= 0.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        _int("top_k", self.top_k, lo=-1)
        _num("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:  # signed 64-bit: torch.Generator.manual_seed, the IPC's msgpack ints
            _int("seed", self.seed, lo=-(2**63), hi=MAX_SEED)
            if self.seed > MAX_SEED - (self.n - 1):
                raise ValueError(f"seed: with n={self.n}, sample i draws with seed + i, and seed {self.seed} + "
                                 f"{self.n - 1} exceeds the largest seed {MAX_SEED}")
        _num("repetition_penalty", self.repetition_penalty, lo=0.0)
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        _num("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _num("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, lo=1)
        _int("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: {self.min_tokens} is larger than max_tokens {self.max_tokens}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop: every stop string must be a non-empty string, got {s!r}")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, lo=0)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if len(self.logit_bias or {}) > MAX_LOGIT_BIAS_TOKENS:
            raise ValueError(f"logit_bias: at most {MAX_LOGIT_BIAS_TOKENS} tokens, got {len(self.logit_bias)}")
        for t, b in (self.logit_bias or {}).items():
            _int("logit_bias", t, lo=0)
            _num("logit_bias", b, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
        if self.structured_outputs is not None:
            so = self.structured_outputs
            if not isinstance(so, dict) or not isinstance(so.get("kind"), str) or not isinstance(so.get("value"), str) \
                    or not isinstance(so.get("after", 0), int) or isinstance(so.get("after"), bool):
                raise ValueError(f"structured_outputs: must be {{'kind': str, 'value': str[, 'after': int]}}, "
                                 f"got {so!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean, got {getattr(self, name)!r}")

    # ---- derived -------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def needs_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def for_sample(self, i: int) -> SamplingParams:
        """Params of the i-th of `n` samples: n=1, seed + i (so each sample is reproducible alone)."""
        d = self.to_dict()
        d["n"] = 1
        if self.seed is not None:
            d["seed"] = self.seed + i
        return SamplingParams(**d)

    # ---- IPC -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.logit_bias is not None:  # msgpack maps take string keys only (ipc.py: strict_map_key)
            d["logit_bias"] = {str(t): b for t, b in self.logit_bias.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown sampling parameter")
        return cls(**d)


def logit_bias_ids(bias: Any) -> dict[int, float] | None:
    """logit_bias with int token ids: OpenAI and the IPC send them as strings of digits."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias: must be a map of token id to bias, got {type(bias).__name__}")
    out = {}
    for t, b in bias.items():
        if isinstance(t, str):
            if not (t.isascii() and t.isdigit()):
                raise ValueError(f"logit_bias: {t!r} is not a token id")
            t = int(t)
        out[t] = b
    return out


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name}: must be an integer, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name}: {v} out of range [{lo}, {hi if hi is not None else 'inf'}]")


def _num(name: str, v: Any, lo: float | None = None, hi: float | None = None) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{name}: must be a finite number, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ValueError(f"{name}: {v} out of range [{lo}, {hi if hi is not None else 'inf'}]")
