"""Speculative decoding with the MTP layer in the ledger: which forwards one decode step runs, and how many tokens
a request gains from it.

Owns: the forwards of a decode step (`step_forwards`) — without speculation the main model over the batch; with it
(engine/mtp.py, request-path stage 7; note 000's "draft, verify, draft_extend") the main model over each request's
last token and its k drafts (the verify, replayed as one token a row: forward_batch.as_decode_rows), the MTP layer
over the positions whose next token is known (E a request, its first draft at the last), then k - 1 chained MTP
forwards of one token a request — the tokens a step emits
under a per-position acceptance rate (`expected_tokens`), and the rate at which drafting stops paying
(`break_even_acceptance`). The byte and collective terms of each forward are marginal.py's. Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dsaserve.ledger.deployment import Assumptions


@dataclass(frozen=True)
class Forward:
    """One forward of a decode step. `part` "main": the decoder layers and the lm_head; "mtp": the MTP layer and
    the lm_head it shares. `queries`: tokens a request (each gathers its own top-k rows), `logits_rows`: rows the
    lm_head computes over the deployment, `key_reads`: reads of a request's indexer keys a full layer (the verify
    replays the decode graphs as one token a row, each scoring the keys itself; an MTP extend's queries share a
    read, as a prefill chunk's)."""

    part: str
    tokens: int
    queries: float
    logits_rows: int
    key_reads: float = 1.0


def drafts(asm: Assumptions) -> int:
    """Drafts a request each decode step verifies (0: speculation off)."""
    return asm.speculative_num_steps if asm.speculative else 0


def acceptance(asm: Assumptions) -> tuple[float, ...]:
    """The chance a draft is kept when the ones before it were, at positions 1, 2, ... (the last repeats)."""
    if asm.draft_acceptance_by_position:
        return tuple(float(x) for x in asm.draft_acceptance_by_position.split(","))
    return (asm.draft_acceptance,)


def expected_tokens(k: int, rates: float | Sequence[float]) -> float:
    """Tokens a request emits in a step verifying k drafts: the token sampled after the last kept draft, plus each
    draft j, kept with probability a_1 ... a_j (only when every draft before it was; one rate: a^j)."""
    rates = (rates,) if isinstance(rates, int | float) else tuple(rates)
    total = kept = 1.0
    for j in range(k):
        kept *= rates[min(j, len(rates) - 1)]
        total += kept
    return total


def step_forwards(batch: int, k: int, rates: float | Sequence[float]) -> list[Forward]:
    """The forwards of one decode step over `batch` requests verifying k drafts each (k = 0: plain decoding)."""
    if k == 0:
        return [Forward("main", batch, 1, batch)]
    verify = batch * (k + 1)
    e = expected_tokens(k, rates)
    extend = Forward("mtp", max(batch, round(batch * e)), e, batch)  # the kept tokens' positions, + the last
    return [Forward("main", verify, k + 1, verify, k + 1), extend, *[Forward("mtp", batch, 1, batch)] * (k - 1)]


def break_even_acceptance(cost: Callable[[float], float], k: int, tol: float = 1e-4) -> float | None:
    """The acceptance rate from which a step verifying k drafts costs less a token than plain decoding: the a with
    E(k, a) = cost(a), where cost(a) is that step's time over the plain step's (it grows a little with a: the MTP
    layer's first forward covers the kept tokens). None when even a = 1 does not pay."""
    if expected_tokens(k, 1.0) < cost(1.0):
        return None
    if expected_tokens(k, 0.0) >= cost(0.0):
        return 0.0  # pays with no draft kept (a step costs no more with them)
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(k, mid) < cost(mid) else (lo, mid)
    return hi
