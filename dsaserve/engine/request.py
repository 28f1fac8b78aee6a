"""Request state inside the engine core (request path stages 2-3 and 10).

Owns: `EngineRequest` (what enters the core), `TokenDelta` (what leaves it each step) and `Req`, the
scheduler's per-sequence bookkeeping: tokens, how many of them are in KV (`num_computed`), the pages
that hold them, the page-table row, the prefix-cache chain hashes, the sampling generator. A request
with `n` samples is `n` Reqs (`index` 0..n-1); the followers (index > 0) wait, holding nothing, until
the leader's prompt is in KV, then fork from it (sharing its full prompt pages).

Uniform accounting (vLLM v1): a Req never distinguishes "prefill" from "decode"; each step it computes
some of `len(tokens) - num_computed` pending tokens, and when none is left after the step it samples.
"""

from __future__ import annotations

import enum
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from dsaserve.common.sampling_params import SamplingParams


def placeholder(sample_row: int) -> int:
    """The host's stand-in in `Req.tokens` for the token sampled in row `sample_row` of the step still on the
    device (overlap scheduling, engine/overlap.py): negative, so never a real id; the runner reads it as
    `future_token_ids[sample_row]`."""
    return -1 - sample_row


@dataclass
class EngineRequest:
    """One request entering the core. `prompt_token_ids` are already tokenized (chat template applied)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.time)


@dataclass(slots=True)
class TokenDelta:
    """What one step produced for one sample of one request.

    `new_logprobs` (when the request asked for logprobs): one dict per new token,
    {"logprob": float, "top": [[token_id, logprob], ...]} from the raw model distribution.
    `prompt_logprobs` (when it asked for them; once, with the sample's first delta): one entry per prompt token,
    None for the first, else {"logprob": float, "rank": int, "top": [[token_id, logprob], ...]}.
    `finish_reason`: "stop" (EOS or a stop token id), "length" (max_tokens or context), "abort".
    `stop_reason`: the stop token id that ended it (None for EOS and the other reasons), as vLLM.
    `index`: which of the request's `n` samples (0 when n == 1). A request is done when every index is.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict] | None
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    index: int = 0
    stop_reason: int | None = None
    prompt_logprobs: list[dict | None] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # in the waiting queue, holds no pages (new or preempted)
    PARKED = "parked"  # a follower of an n>1 request, waiting for its leader's prompt
    RUNNING = "running"  # holds pages and a page-table row
    FINISHED = "finished"


class Req:
    """One sequence the scheduler runs. Plain attributes (slots) because the decode loop touches them."""

    __slots__ = (
        "request_id", "index", "sampling", "arrival_time", "seq_no", "tokens", "prompt_len", "max_len",
        "stop_ids", "status", "pages", "num_computed", "num_cached_tokens", "page_hashes", "num_registered",
        "chain_uid",
        "row", "row_gen", "pages_synced", "generator", "finish_reason", "stop_reason", "followers", "leader",
        "num_emitted", "pending_logprobs", "num_preemptions", "grammar", "prompt_logprobs", "prompt_lp_asked",
        "prompt_lp_sent", "drafts",
    )

    def __init__(self, request_id: str, index: int, prompt: list[int], sampling: SamplingParams,
                 arrival_time: float, seq_no: int, max_len: int, stop_ids: frozenset[int]):
        self.request_id, self.index, self.sampling = request_id, index, sampling
        self.arrival_time, self.seq_no = arrival_time, seq_no
        self.tokens: list[int] = list(prompt)  # prompt + output
        self.prompt_len = len(prompt)
        self.max_len = max_len  # prompt + output never exceeds this (max_tokens and context)
        self.stop_ids = stop_ids  # stop_token_ids, plus EOS unless ignore_eos
        self.status = ReqStatus.WAITING
        self.pages: list[int] = []
        self.num_computed = 0  # tokens whose KV is in `pages`
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.page_hashes: list[bytes] = []  # chain hash of each full page of `tokens` (lazily extended)
        self.num_registered = 0  # leading pages already offered to the prefix cache
        self.chain_uid = 0  # prefix-cache registration id the next full page hangs off (-1: chain broken)
        self.row = -1  # page-table row while RUNNING
        self.row_gen = -1  # which taking of a row this is (the scheduler's count): engine/page_table_mirror.py
        self.pages_synced = 0  # pages already written into the row (engine/batch.py)
        self.generator: Any = None  # torch.Generator for seeded sampling (created by the sampler)
        self.finish_reason: str | None = None
        self.stop_reason: int | None = None
        self.followers: list[Req] = []  # n>1: samples 1..n-1 parked until this leader's prompt is in KV
        self.leader: Req | None = None
        self.num_emitted = 0  # output tokens already reported in a TokenDelta
        self.pending_logprobs: list[dict] | None = [] if sampling.logprobs is not None else None
        # prompt logprobs: entries so far (None for position 0; an n>1 request's samples share the list), and the
        # positions before `prompt_lp_asked` whose entries a launched step computes (engine/prompt_logprobs.py)
        self.prompt_logprobs: list[dict | None] | None = [None] if sampling.prompt_logprobs is not None else None
        self.prompt_lp_asked = 0
        self.prompt_lp_sent = False
        self.num_preemptions = 0
        self.grammar: Any = None  # engine/grammar.py GrammarState of a structured-output request
        # speculative decoding (engine/mtp.py): the MTP layer's guesses at the tokens after the last one; the next
        # decode step computes the last token and these together and keeps those the sampler agrees with
        self.drafts: list[int] = []

    # ---- views the sampler reads (model/sampler.py SampleSource) ---------------------------
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.tokens[: self.prompt_len]

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def suppressed_token_ids(self) -> tuple[int, ...]:
        """Stop tokens are masked until `min_tokens` outputs exist (vLLM's min_tokens)."""
        if self.num_output < self.sampling.min_tokens:
            return tuple(self.stop_ids)
        return ()

    # ---- scheduling ------------------------------------------------------------------------
    @property
    def cacheable_tokens(self) -> int:
        """Leading tokens the prefix cache may serve (in whole pages): never the last (its logits are sampled),
        and for prompt logprobs no position not yet asked for (a cached position is never computed)."""
        tokens = len(self.tokens) - 1
        if self.prompt_logprobs is not None and self.prompt_lp_asked < self.prompt_len - 1:
            tokens = min(tokens, self.prompt_lp_asked)
        return tokens

    @property
    def num_pending(self) -> int:
        """Tokens not yet in KV: the whole prompt at first, 1 while decoding."""
        return len(self.tokens) - self.num_computed

    @property
    def priority(self) -> tuple[float, int]:
        """Older first; the newest running request is the first preempted."""
        return (self.arrival_time, self.seq_no)

    def drop_placeholder(self) -> None:
        """Forget a token still on its way (the sample was aborted): it is never reported."""
        if len(self.tokens) > self.prompt_len and self.tokens[-1] < 0:
            self.tokens.pop()

    def delta(self, finished: bool) -> TokenDelta:
        """Output tokens (and logprobs) not yet reported, and mark them reported."""
        new = self.tokens[self.prompt_len + self.num_emitted:]
        self.num_emitted = len(self.tokens) - self.prompt_len
        lps = self.pending_logprobs
        if lps is not None:
            self.pending_logprobs = []
        plp = self.prompt_logprobs
        if self.prompt_lp_sent or plp is None or len(plp) < self.prompt_len:  # an abort before the end has none
            plp = None
        self.prompt_lp_sent = self.prompt_lp_sent or plp is not None
        if finished:
            return TokenDelta(self.request_id, new, lps, True, self.finish_reason, self.prompt_len,
                              self.num_cached_tokens, self.index, self.stop_reason, plp)
        return TokenDelta(self.request_id, new, lps, False, None, self.prompt_len, self.num_cached_tokens, self.index,
                          prompt_logprobs=plp)

    def __repr__(self) -> str:
        return (f"Req({self.request_id}#{self.index} {self.status.value} tokens={len(self.tokens)} "
                f"computed={self.num_computed} pages={len(self.pages)})")
