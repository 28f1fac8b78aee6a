"""Structured output: grammar specs, their compilation, and the per-sample matcher (request path stage 9;
startup chain: warmup of `--precompile-schemas`).

Owns: `GrammarSpec` (what a request asks for: `json_schema`, `json_object`, `regex`, `choice`, `grammar`
(EBNF); canonical text, so the cache key of a schema ignores key order and spacing), the static limits that
refuse hostile specs before any compile work (nesting depth, enum/const sizes, spec size, regex repeat
bounds — each error says which limit and where), `GrammarCompiler` (xgrammar over the checkpoint's
vocabulary, compiling on a worker thread with a timeout, a cache keyed by spec holding successes *and*
failures), and `GrammarState` (one sample's matcher: fill its row of the token bitmask, accept the
sampled token).

Why xgrammar rather than llguidance: both are maintained and both are used by vLLM and SGLang. xgrammar
precomputes, per grammar, which tokens are context-independent, so filling a bitmask row at decode time is
a few microseconds for JSON-schema grammars (the common case here); it compiles JSON Schema, regex, EBNF and
structural tags; its compiled grammars serialise; and it is SGLang's default backend, the closest peer.
llguidance needs no precompile (a plus for one-off huge schemas) but computes masks lazily per step;
with compiles off the scheduler loop and cached, xgrammar's up-front cost is what we can afford best.

Compiles never run on the step loop: `submit` returns a Future (the grammar gate, engine/grammar_gate.py, waits
for it on every rank while the ranks step other requests); `compile` blocks with a timeout (startup warmup, an
EngineCore driven without a RankGroup). A
compile that times out is cached as a failure; its thread runs to completion in the background (xgrammar
cannot be interrupted), which the static limits keep to seconds.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 << 10  # a schema / regex / grammar larger than 64 KiB is refused
MAX_DEPTH = 16  # nesting of a JSON schema (xgrammar compile time grows fast with depth: 200 -> 3 s)
MAX_ENUM_VALUES = 1024  # enum/const values over the whole schema (20k values take 12 s to compile)
MAX_CHOICES = 1024
MAX_REPEAT = 1024  # bound of a regex {n,m} repetition
COMPILE_TIMEOUT_S = 10.0
CACHE_SIZE = 512
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class GrammarError(ValueError):
    """A spec that is invalid, over a limit, or failed / timed out compiling; the message says why."""


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    value: str  # canonical: schema JSON without spacing, the regex, the choices as a JSON list, the EBNF

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "value": self.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GrammarSpec:
        return make_spec(d.get("kind", ""), d.get("value"))


def make_spec(kind: str, value: Any) -> GrammarSpec:
    """Validate and canonicalise; GrammarError names the problem."""
    if kind not in KINDS:
        raise GrammarError(f"structured output kind {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "json_object":
        return GrammarSpec(kind, "")
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except (ValueError, RecursionError) as e:
                raise GrammarError(f"json schema: not valid JSON ({e})") from None
        if not isinstance(value, (dict, bool)):
            raise GrammarError("json schema: must be a JSON object")
        # key order is kept: xgrammar generates properties in schema order, which clients expect
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        check_schema(value, len(text))
        return GrammarSpec(kind, text)
    if kind == "choice":
        if isinstance(value, str):  # the canonical form (GrammarSpec.value) read back
            try:
                value = json.loads(value)
            except ValueError:
                raise GrammarError("choice: must be a non-empty list of strings") from None
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise GrammarError("choice: must be a non-empty list of strings")
        if len(value) > MAX_CHOICES:
            raise GrammarError(f"choice: {len(value)} choices, more than the limit of {MAX_CHOICES}")
        return GrammarSpec(kind, json.dumps(value, ensure_ascii=False))
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{kind}: must be a non-empty string")
    if len(value) > MAX_SPEC_CHARS:
        raise GrammarError(f"{kind}: {len(value)} characters, more than the limit of {MAX_SPEC_CHARS}")
    if kind == "regex":
        check_regex(value)
    return GrammarSpec(kind, value)


def check_schema(schema: Any, size: int) -> None:
    """Refuse schemas whose compile would be slow: too big, too deep, too many enum values."""
    if size > MAX_SPEC_CHARS:
        raise GrammarError(f"json schema: {size} characters, more than the limit of {MAX_SPEC_CHARS}")
    enums = 0
    stack: list[tuple[Any, int, str]] = [(schema, 0, "$")]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            raise GrammarError(f"json schema: nested deeper than the limit of {MAX_DEPTH} levels (at {path})")
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                enums += len(node["enum"])
            enums += "const" in node
            if isinstance(node.get("pattern"), str):
                check_regex(node["pattern"], f"pattern at {path}")
            stack.extend((v, depth + 1, f"{path}.{k}") for k, v in node.items() if k not in ("enum", "const"))
        elif isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node))
        if enums > MAX_ENUM_VALUES:
            raise GrammarError(f"json schema: more than {MAX_ENUM_VALUES} enum/const values in total")


def check_regex(rx: str, what: str = "regex") -> None:
    """A regex xgrammar can compile in bounded time: valid, and every repetition bound <= MAX_REPEAT."""
    try:
        re.compile(rx)
    except re.error as e:
        raise GrammarError(f"{what}: invalid regular expression ({e})") from None
    except RecursionError:
        raise GrammarError(f"{what}: nested too deeply") from None
    for m in _REPEAT.finditer(rx):
        bounds = [int(b) for b in m.groups() if b]
        if any(b > MAX_REPEAT for b in bounds):
            raise GrammarError(f"{what}: repetition {m.group(0)} exceeds the limit of {MAX_REPEAT}")


def load_precompile_file(path: str) -> list[GrammarSpec]:
    """`--precompile-schemas FILE`: a JSON list whose entries are JSON schemas, or {"kind", "value"} specs."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--precompile-schemas: cannot read {path}: {e}") from None
    if not isinstance(entries, list):
        raise ValueError(f"--precompile-schemas: {path} must hold a JSON list of schemas")
    specs = []
    for i, e in enumerate(entries):
        try:
            is_spec = isinstance(e, dict) and set(e) == {"kind", "value"}
            specs.append(GrammarSpec.from_dict(e) if is_spec else make_spec("json_schema", e))
        except GrammarError as err:
            raise ValueError(f"--precompile-schemas: entry {i} of {path}: {err}") from None
    return specs


def choice_regex(choices: list[str]) -> str:
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def encoded_vocab(tokenizer: Any) -> list[str]:
    """A `tokenizers.Tokenizer`'s pieces in id order, special tokens as "" (never allowed by a grammar)."""
    added = tokenizer.get_added_tokens_decoder()
    return ["" if (i in added and added[i].special) else (tokenizer.id_to_token(i) or "")
            for i in range(tokenizer.get_vocab_size(with_added_tokens=True))]


class GrammarCompiler:
    """xgrammar over one vocabulary; cache keyed by GrammarSpec, failures included."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], *,
                 timeout_s: float = COMPILE_TIMEOUT_S, max_workers: int = 1, byte_level: bool = True) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        vocab_type = xgr.VocabType.BYTE_LEVEL if byte_level else xgr.VocabType.RAW
        self.info = xgr.TokenizerInfo(encoded_vocab(tokenizer), vocab_type, vocab_size=vocab_size,
                                      stop_token_ids=list(stop_token_ids))
        self.vocab_size = vocab_size
        self.json_allowed = _no_control_chars(tokenizer, vocab_size, xgr)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.timeout_s = timeout_s
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grammar")
        self.cache: dict[GrammarSpec, Future] = {}
        self.lock = threading.Lock()
        self.stats = {"hits": 0, "misses": 0, "failures": 0, "timeouts": 0}

    def submit(self, spec: GrammarSpec) -> Future:
        """The (possibly still running) compile of spec; the same Future for the same spec."""
        with self.lock:
            fut = self.cache.get(spec)
            if fut is not None:
                self.stats["hits"] += 1
                return fut
            self.stats["misses"] += 1
            if len(self.cache) >= CACHE_SIZE:  # drop the oldest finished entry
                old = next((k for k, f in self.cache.items() if f.done()), None)
                if old is not None:
                    del self.cache[old]
            fut = self.pool.submit(self._compile, spec)
            self.cache[spec] = fut
            return fut

    def compile(self, spec: GrammarSpec, timeout: float | None = None) -> Any:
        """Blocking compile with a timeout; GrammarError on failure or timeout (then cached as failed)."""
        fut = self.submit(spec)
        try:
            return fut.result(timeout=self.timeout_s if timeout is None else timeout)
        except TimeoutError:
            self.fail(spec, f"compiling took longer than {self.timeout_s if timeout is None else timeout:g} s")
            raise GrammarError(f"{spec.kind}: compiling took longer than the limit") from None

    def fail(self, spec: GrammarSpec, reason: str) -> None:
        """Cache spec as failed (a timeout): later requests with it fail at once."""
        failed: Future = Future()
        failed.set_exception(GrammarError(f"{spec.kind}: {reason}"))
        with self.lock:
            self.cache[spec] = failed
            self.stats["timeouts"] += 1

    def _compile(self, spec: GrammarSpec) -> Any:
        c = self.compiler
        try:
            if spec.kind == "json_object":  # an object, as OpenAI guarantees (the builtin JSON grammar takes any value)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "json_schema":
                return c.compile_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            if spec.kind == "choice":
                return c.compile_regex(choice_regex(json.loads(spec.value)))
            if spec.kind == "regex":
                return c.compile_regex(spec.value)
            return c.compile_grammar(spec.value)
        except Exception as e:  # xgrammar raises RuntimeError with the C++ location first: keep the reason
            self.stats["failures"] += 1
            msg = str(e).strip().splitlines()
            reason = next((ln.split(": ", 1)[-1] for ln in msg if ln.strip()), type(e).__name__)
            raise GrammarError(f"{spec.kind}: cannot be compiled: {reason}"[:400]) from None

    def state(self, compiled: Any, spec: GrammarSpec | None = None, after: int | None = None) -> GrammarState:
        """A fresh matcher; JSON grammars also never allow a raw control character (xgrammar's bounded-length
        strings admit them, and JSON does not). `after`: the grammar starts once this token (the reasoning
        end) is sampled; the reasoning before it is free text."""
        extra = self.json_allowed if spec is None or spec.is_json else None
        return GrammarState(self.xgr.GrammarMatcher(compiled), self.vocab_size, extra, after)


def _no_control_chars(tokenizer: Any, vocab_size: int, xgr: Any) -> Any:
    """Bitmask row (int32 words) of the tokens whose text has no character below U+0020."""
    import torch

    allowed = torch.zeros(vocab_size + 31, dtype=torch.bool)
    n = min(tokenizer.get_vocab_size(with_added_tokens=True), vocab_size)
    for i in range(n):
        text = tokenizer.decode([i], skip_special_tokens=False)
        allowed[i] = not any(ord(c) < 0x20 for c in text)
    allowed[n:] = True  # the grammar itself refuses ids past the tokenizer
    words = allowed[: (vocab_size + 31) // 32 * 32].view(-1, 32).to(torch.int64)
    packed = (words << torch.arange(32, dtype=torch.int64)).sum(dim=1)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


class GrammarState:
    """One sample's position in its grammar."""

    __slots__ = ("matcher", "vocab_size", "broken", "extra", "wait_token")

    def __init__(self, matcher: Any, vocab_size: int, extra: Any = None, wait_token: int | None = None) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.extra = extra  # an int32 bitmask row ANDed into every row this state fills
        self.wait_token = wait_token  # the grammar starts after this token (None: from the first token)
        self.broken = False  # a token the grammar refused was forced in (never by the sampler): stop masking

    @property
    def active(self) -> bool:
        """The next token is constrained."""
        return self.wait_token is None and not self.broken and not self.matcher.is_terminated()

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: Any, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.extra is not None:
            bitmask[row] &= self.extra

    def observe(self, token_id: int) -> None:
        """A sampled token: the grammar's next step, or (while waiting) maybe the token that starts it."""
        if self.wait_token is not None:
            if token_id == self.wait_token:
                self.wait_token = None
        elif self.active:
            self.accept(token_id)

    def accept(self, token_id: int) -> bool:
        if not self.active:
            return False
        ok = self.matcher.accept_token(int(token_id))
        if not ok:
            self.broken = True
        return ok


class DraftGrammar:
    """A draft's row of a constrained request (speculative decoding, engine/mtp.py): its mask is the grammar's as if
    the drafts before the row had been taken — taken on the request's own matcher for the fill, then rolled back
    (xgrammar keeps every step: rollback is unbounded). It takes no token itself: after the step the request's
    state takes each kept draft's draw in order (`MTPDrafter.kept`). A row past a draft the grammar refuses, or
    past its end, is unconstrained: the sampler never keeps such a draft, so its row is never read."""

    __slots__ = ("state", "drafts")

    def __init__(self, state: GrammarState, drafts: list[int]) -> None:
        self.state, self.drafts = state, drafts

    @property
    def vocab_size(self) -> int:
        return self.state.vocab_size

    @property
    def active(self) -> bool:
        taken = self._take()
        if taken is None:
            return False
        self._rollback(taken)
        return True

    def fill(self, bitmask: Any, row: int) -> None:
        taken = self._take()
        if taken is None:  # `active` said no: never asked
            raise RuntimeError("DraftGrammar.fill: the grammar is not active after the drafts")
        try:
            self.state.fill(bitmask, row)
        finally:
            self._rollback(taken)

    def observe(self, token_id: int) -> None:
        """A draft row's draw is taken, if its draft is kept, by the request's state (`MTPDrafter.kept`)."""

    def _take(self) -> int | None:
        """The drafts taken on the matcher as `GrammarState.observe` takes tokens: how many it accepted (to roll
        back), or None (nothing left taken) when the grammar is not active after them."""
        s, waiting, taken = self.state, self.state.wait_token, 0
        if s.broken:
            return None
        try:
            for d in self.drafts:
                if waiting is not None:  # the reasoning before the grammar starts: free text
                    waiting = None if d == waiting else waiting
                    continue
                if s.matcher.is_terminated() or not s.matcher.accept_token(int(d)):
                    break
                taken += 1
            else:
                if waiting is None and not s.matcher.is_terminated():
                    return taken
        except BaseException:
            self._rollback(taken)
            raise
        self._rollback(taken)
        return None

    def _rollback(self, taken: int) -> None:
        if taken:
            self.state.matcher.rollback(taken)
