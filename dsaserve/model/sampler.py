"""Sampler: logits -> next tokens (+ logprobs), batched, per-row parameters (request path stage 9).

Owns: the order of logits processing (vLLM's): raw logprobs for the response -> stop-token suppression
(min_tokens) -> the structured-output grammar's token bitmask ->
repetition / frequency / presence penalties -> greedy rows take the argmax; the others
divide by temperature, apply top-k, top-p, min-p, and draw with the exponential race
argmax(p / q), q ~ Exp(1), which samples exactly from p.

Reproducibility: a request with a seed draws its q from its own torch.Generator (seeded once, advanced
only by its own draws), and every step of the pipeline is row-local, always run the same way whatever
the other rows need (filters that are off for a row leave it bit-identical). So a seed gives the same
token whatever else is in the batch. Requests without a seed share one engine generator.

Grammar bitmask: xgrammar fills one int32 row per grammar-constrained sample on the CPU (bit t of word w
allows token 32w + t); `apply_token_bitmask` unpacks the rows with uint8 shifts and masks the logits with
`masked_fill` — plain torch ops, the same on CPU and GPU, touching only the constrained rows. The fill
runs before anything waits for the device, so on a GPU it overlaps the step's forward. When the tokens reach
the host (`SampleFuture.result`) each constrained sample's matcher takes its token (a grammar waiting for the
reasoning end only watches for it).

Nothing between `sample_async` and `SampleFuture.result` waits for the device (host lists travel through
`to_device`), so under overlap scheduling (engine/overlap.py) the host goes on to schedule the next step while
the tokens are drawn. Exceptions, each a rare combination: min_tokens together with a grammar.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dsaserve.common.host_lists import HostCopy, to_device
from dsaserve.common.sampling_params import SamplingParams
from dsaserve.kernels.registry import get_ops


class SampleSource(Protocol):
    """What the sampler reads of a request (engine/request.py Req implements it)."""

    sampling: SamplingParams
    generator: Any  # torch.Generator | None, created here on first use

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def suppressed_token_ids(self) -> tuple[int, ...]: ...


def generator_seed(seed: int) -> int:
    """A request's signed 64-bit seed as the uint64 `manual_seed` takes, its bits mixed (splitmix64's
    finaliser, a bijection): the CPU generator (mt19937) keeps only the low 32 bits, so seeds 0 and 2**32 drew
    the same tokens there; mixed, every bit of the seed moves those 32."""
    z = seed & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFF_FFFF_FFFF_FFFF
    return z ^ (z >> 31)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict | None]  # {"logprob": float, "top": [[id, logprob], ...]} where asked for


class SampleFuture:
    """One step's samples, drawn on the device and on their way to the host.

    `tokens` ([rows] int64) stay on the device, where the next step's input ids read them under overlap
    scheduling (engine/overlap.py). Their host copy, and the logprobs', is queued at once into pinned memory
    behind an event; `result()` waits for it, then lets each grammar take its token."""

    def __init__(self, rows: Sequence[SampleSource], tokens: torch.Tensor,
                 logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, want: list[int]):
        self.rows, self.tokens, self._want = rows, tokens, want
        self._copy = HostCopy([tokens, *(logprobs or ())])

    def result(self) -> SamplerOutput:
        token_list, *logprobs = self._copy.lists()
        for r, t in zip(self.rows, token_list, strict=True):
            g = getattr(r, "grammar", None)
            if g is not None:
                g.observe(t)
        return SamplerOutput(token_list, self._logprob_dicts(logprobs))

    def _logprob_dicts(self, logprobs: list[list]) -> list[dict | None]:
        out: list[dict | None] = [None] * len(self.rows)
        if not self._want:
            return out
        chosen, top_v, top_i = logprobs
        for j, i in enumerate(self._want):
            n = self.rows[i].sampling.logprobs
            out[i] = {"logprob": chosen[j], "top": [[t, v] for t, v in zip(top_i[j][:n], top_v[j][:n], strict=True)]}
        return out


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._shared: dict[str, torch.Generator] = {}  # device -> generator of unseeded requests

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleSource]) -> SamplerOutput:
        """logits: [len(rows), vocab] float32 or bf16 (one row per sample). Waits for the tokens."""
        return self.sample_async(logits, rows).result()

    def sample_async(self, logits: torch.Tensor, rows: Sequence[SampleSource]) -> SampleFuture:
        """Queue the sampling of [len(rows), vocab] logits on their device; nothing here waits for the device
        (every host list reaches it through `to_device`), so on a GPU the host returns while the forward the
        logits come from may still run. Host state (grammar matchers, output ids for penalties, min_tokens) is
        read now: it must already hold every earlier token of these rows. bf16 logits (the lm_head's own dtype)
        are read as they are by the argmax of a batch of plain greedy rows (exact: bf16 -> float32 is); any other
        batch works on their float32 copy, so every result is the float32 logits' bit for bit."""
        params = [r.sampling for r in rows]
        raw = logits
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = self._logprobs_inputs(raw, want)
        x = logits if _plain_greedy(rows, params) else logits.float()
        x = self._bias(x, params)
        x = self._suppress(x, rows)
        x = self._grammar_mask(x, rows)
        if any(p.needs_penalties for p in params):
            x = apply_penalties(x if x is not raw else x.clone(), rows)
        if all(p.greedy for p in params):
            tokens = get_ops(x.device).row_argmax(x)
        else:
            tokens = self._random(x, rows, params)
        return SampleFuture(rows, tokens, self._logprobs(logprobs, params, want, tokens), want)

    # ---- steps -------------------------------------------------------------------------------
    @staticmethod
    def _bias(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """logit_bias added to its rows' logits (a new tensor: the raw ones stay for the logprobs)."""
        vocab = x.shape[1]
        cells = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or {}).items() if 0 <= t < vocab]
        if not cells:
            return x
        r, c = to_device([(i, t) for i, t, _ in cells], torch.int64, x.device).unbind(1)
        return x.index_put((r, c), to_device([b for *_, b in cells], x.dtype, x.device), accumulate=True)

    @staticmethod
    def _suppress(x: torch.Tensor, rows: Sequence[SampleSource]) -> torch.Tensor:
        masked = [(i, ids) for i, r in enumerate(rows) if (ids := r.suppressed_token_ids)]
        if not masked:
            return x
        vocab, dev = x.shape[1], x.device
        # ids were validated on admission; out-of-range ones must never index
        cells = [(i, t) for i, ids in masked for t in ids if 0 <= t < vocab]
        if not cells:
            return x
        r, c = to_device(cells, torch.int64, dev).unbind(1)
        return x.index_put((r, c), x.new_full((), float("-inf")))

    @staticmethod
    def _grammar_mask(x: torch.Tensor, rows: Sequence[SampleSource]) -> torch.Tensor:
        states = [(i, g) for i, r in enumerate(rows) if (g := getattr(r, "grammar", None)) is not None and g.active]
        if not states:
            return x
        # filled on the host while the device may still run the forward (nothing before this waits for it);
        # pinned, so the copy to the device is a real async transfer
        bitmask = torch.empty((len(states), -(-states[0][1].vocab_size // 32)), dtype=torch.int32,
                              pin_memory=x.is_cuda)
        for j, (_, g) in enumerate(states):
            g.fill(bitmask, j)
        if any(rows[i].suppressed_token_ids for i, _ in states):  # min_tokens + grammar: the grammar wins
            x = _unsuppress_dead_rows(x, rows, states, bitmask)
        if len(states) == len(rows):
            return apply_token_bitmask(x, bitmask)
        idx = to_device([i for i, _ in states], torch.int64, x.device)
        return x.index_copy(0, idx, apply_token_bitmask(x.index_select(0, idx), bitmask))

    def _random(self, x: torch.Tensor, rows: Sequence[SampleSource], params: list[SamplingParams]) -> torch.Tensor:
        dev = x.device
        greedy = to_device([p.greedy for p in params], torch.bool, dev)
        # past float32's range a temperature would round to inf, and -inf / inf (a masked token) is NaN
        fmax = torch.finfo(x.dtype).max
        temp = to_device([1.0 if p.greedy else min(p.temperature, fmax) for p in params], x.dtype, dev)
        scaled = x / temp.unsqueeze(1)
        if any(p.needs_filters for p in params):
            scaled = apply_filters(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        q = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if len(unseeded) == len(params):
            q.exponential_(generator=self._shared_generator(dev))
        elif unseeded:
            noise = torch.empty((len(unseeded), probs.shape[1]), device=dev, dtype=probs.dtype)
            noise.exponential_(generator=self._shared_generator(dev))
            q.index_copy_(0, to_device(unseeded, torch.int64, dev), noise)
        for i, (r, p) in enumerate(zip(rows, params, strict=True)):
            if p.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=dev)
                    r.generator.manual_seed(generator_seed(p.seed))
                q[i].exponential_(generator=r.generator)
        argmax = get_ops(dev).row_argmax
        return torch.where(greedy, argmax(x), argmax(probs / q))

    def _shared_generator(self, dev: torch.device) -> torch.Generator:
        g = self._shared.get(str(dev))
        if g is None:
            g = torch.Generator(device=dev)
            g.manual_seed(self.seed)
            self._shared[str(dev)] = g
        return g

    @staticmethod
    def _logprobs_inputs(raw: torch.Tensor, want: list[int]) -> torch.Tensor | None:
        if not want:
            return None
        if len(want) < raw.shape[0]:
            raw = raw.index_select(0, to_device(want, torch.int64, raw.device))
        return torch.log_softmax(raw.float(), dim=-1)

    @staticmethod
    def _logprobs(lp: torch.Tensor | None, params: list[SamplingParams], want: list[int], tokens: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(chosen [W], top values [W, k], top ids [W, k]) on the device for the W rows that want logprobs."""
        if lp is None:
            return None
        if len(want) < len(params):
            tokens = tokens.index_select(0, to_device(want, torch.int64, tokens.device))
        chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        k = max(params[i].logprobs for i in want)
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        return chosen, top_v, top_i


def _plain_greedy(rows: Sequence[SampleSource], params: list[SamplingParams]) -> bool:
    """Whether the batch only takes the argmax of its logits as they are (no bias, suppression, grammar or
    penalty changes them, nothing draws from them): the one batch that may read bf16 logits."""
    return (all(p.greedy and not p.logit_bias and not p.needs_penalties for p in params)
            and not any(r.suppressed_token_ids or getattr(r, "grammar", None) is not None for r in rows))


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] with the tokens not allowed by bitmask [rows, ceil(vocab'/32)] int32 set to -inf.

    Plain torch, the same code on CPU and GPU: the int32 words are read as little-endian bytes (token
    32w + 8k + b is bit b of byte k of word w), unpacked with one uint8 shift, and used by masked_fill."""
    vocab, dev = x.shape[1], x.device
    raw = bitmask.to(dev, non_blocking=True).contiguous().view(torch.uint8)
    allowed = ((raw.unsqueeze(-1) >> _bit_shifts(dev)) & 1).view(raw.shape[0], -1).bool()
    if allowed.shape[1] < vocab:  # ids past the grammar's vocabulary are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    return x.masked_fill(~allowed[:, :vocab], float("-inf"))


@functools.lru_cache(maxsize=8)
def _bit_shifts(dev: torch.device) -> torch.Tensor:
    """0..7 on the sampling device, made once per device (not a host-to-device copy every step)."""
    return torch.arange(8, dtype=torch.uint8, device=dev)


def _unsuppress_dead_rows(x: torch.Tensor, rows: Sequence[SampleSource], states: list, bitmask: torch.Tensor
                          ) -> torch.Tensor:
    """Rows whose min_tokens suppression removed every token their grammar allows get the suppressed tokens
    back (a grammar that must end now ends now)."""
    x = x.clone()
    for j, (i, _) in enumerate(states):
        ids = [t for t in rows[i].suppressed_token_ids if 0 <= t < x.shape[1]]
        if ids and torch.isinf(apply_token_bitmask(x[i:i + 1], bitmask[j:j + 1])).all():
            x[i, ids] = 0.0
    return x


# Repetition penalties in [_REP_LO, _REP_HI] keep vLLM's arithmetic as it is: logits up to 1e10 in size stay within
# _PENALISED_MAX there. Further out float32 breaks (r rounds to 0 or inf), so `_repetition` bounds what grows.
_REP_LO, _REP_HI = 1e-20, 1e20
_PENALISED_MAX = 1e30  # divided by the smallest sampled temperature (1e-5) it stays finite in float32 (< 3.4e38)


def apply_penalties(x: torch.Tensor, rows: Sequence[SampleSource]) -> torch.Tensor:
    """In place on x (a private copy): vLLM semantics.

    repetition_penalty r on tokens seen in prompt or output: positive logits / r, negative * r
    (`_repetition`: every r > 0 gives finite logits, extreme ones their limit);
    frequency f and presence p on output tokens: logit -= f * count + p * (count > 0).
    """
    vocab, dev = x.shape[1], x.device
    for i, row in enumerate(rows):
        sp = row.sampling
        if not sp.needs_penalties:
            continue
        out_ids = to_device(row.output_token_ids, torch.int64, dev)
        # scatter, not bincount: CUDA's bincount reads the max id back to the host (a sync per row)
        counts = torch.zeros(vocab, dtype=x.dtype, device=dev).index_add_(
            0, out_ids, torch.ones(out_ids.numel(), dtype=x.dtype, device=dev))
        if sp.repetition_penalty != 1.0:
            seen = counts > 0
            seen.index_fill_(0, to_device(row.prompt_token_ids, torch.int64, dev), True)  # `seen[ids] = True` syncs
            x[i] = _repetition(x[i], seen, sp.repetition_penalty)
        if sp.frequency_penalty or sp.presence_penalty:
            x[i] -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(x.dtype)
    return x


def _repetition(xi: torch.Tensor, seen: torch.Tensor, r: float) -> torch.Tensor:
    """One row's repetition penalty: seen positive logits / r, seen negative ones * r.

    Inside [_REP_LO, _REP_HI] exactly that. Outside, plain float32 would answer NaN or inf (1e-308 rounds to 0:
    x / 0 = inf, -inf * 0 = NaN; 1e308 rounds to inf: 0 * inf = NaN, and every seen negative logit ties at
    -inf), and softmax or argmax of those is garbage. There the side that grows is scaled by the row's largest
    such logit so that it ends at most _PENALISED_MAX in size: the seen tokens keep their order, they still
    dominate (r -> 0) or drop out (r -> inf) as in the limit, and masked tokens (-inf) stay masked.
    """
    if _REP_LO <= r <= _REP_HI:
        return torch.where(seen, torch.where(xi > 0, xi / r, xi * r), xi)
    info = torch.finfo(xi.dtype)
    pos = seen & (xi > 0)
    if r < _REP_LO:  # no sync: the row's largest finite seen positive logit stays on the device (+inf / inf: NaN)
        top = xi.masked_fill(~(pos & xi.isfinite()), 0).amax()
        grown = xi / (top / _PENALISED_MAX).clamp(min=max(r, info.tiny))
        return torch.where(pos, grown, torch.where(seen, xi * max(r, info.tiny), xi))
    r = min(r, info.max)
    bottom = (-xi).masked_fill(~(seen & (xi <= 0) & xi.isfinite()), 0).amax()
    grown = xi * (_PENALISED_MAX / bottom).clamp(max=r)
    return torch.where(pos, xi / r, torch.where(seen, grown, xi))


def apply_filters(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, top-p, min-p per row on temperature-scaled logits; masked entries become -inf.

    Rows with a filter off get a keep-everything threshold, so they come out bit-identical.
    """
    vocab, dev = x.shape[1], x.device
    top_k = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.int64, dev)
    top_p = to_device([p.top_p for p in params], x.dtype, dev)
    min_p = to_device([p.min_p for p in params], x.dtype, dev)
    if any(p.min_p > 0 for p in params):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < (probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)), float("-inf"))
    if not any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        return x
    srt, idx = x.sort(dim=-1, descending=False)
    # top-k: keep values >= the k-th largest (ties kept); k = vocab keeps all
    kth = srt.gather(1, (vocab - top_k).unsqueeze(1))
    drop = srt < kth
    # top-p: drop the smallest tokens whose cumulative probability stays within 1 - top_p
    cum = torch.softmax(srt.masked_fill(drop, float("-inf")), dim=-1).cumsum(dim=-1)
    drop_p = (cum <= (1 - top_p).unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop_p[:, -1] = False  # the most likely token always survives
    drop = drop | drop_p
    return x.masked_fill(torch.zeros_like(drop).scatter_(1, idx, drop), float("-inf"))
