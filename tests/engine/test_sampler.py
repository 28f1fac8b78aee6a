"""Sampler: greedy, temperature, top-k/top-p/min-p, penalties, per-request seeds, logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.model.sampler import Sampler, apply_penalties

V = 32


@dataclass
class Row:
    sampling: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=lambda: [0])
    output_token_ids: list[int] = field(default_factory=list)
    suppressed_token_ids: tuple[int, ...] = ()
    generator: Any = None
    grammar: Any = None


def _logits(seed: int = 0, n: int = 1) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_the_argmax():
    x = _logits(n=4)
    out = Sampler().sample(x, [Row(SamplingParams(temperature=0)) for _ in range(4)])
    assert out.token_ids == x.argmax(-1).tolist()


def test_a_seed_gives_the_same_samples_whatever_else_is_in_the_batch():
    x = _logits(1)
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = Row(sp)
    ref = [Sampler(seed=1).sample(x, [alone]).token_ids[0] for _ in range(30)]
    company = [SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=3),
               SamplingParams(temperature=0.7, min_p=0.2, seed=99), SamplingParams(),
               SamplingParams(presence_penalty=1.0, repetition_penalty=1.3)]
    batched, sampler, row = [], Sampler(seed=2), Row(sp)
    for step in range(30):
        others = [Row(company[(step + j) % len(company)], output_token_ids=[1, 2, 2]) for j in range(step % 4)]
        rows = others[: step % 2] + [row] + others[step % 2:]
        logits = torch.cat([_logits(100 + step, len(rows[: step % 2])), x, _logits(200 + step, len(others) - step % 2)])
        batched.append(sampler.sample(logits, rows).token_ids[step % 2 if others else 0])
    assert batched == ref
    assert len(set(ref)) > 1  # it really sampled


def test_seeds_apart_only_in_their_high_bits_draw_apart():
    """The CPU generator keeps 32 bits of what it is seeded with; the seed's other bits must still count."""
    x = torch.zeros(1, V)

    def draws(seed: int) -> list[int]:
        row, s = Row(SamplingParams(temperature=1.0, seed=seed)), Sampler()
        return [s.sample(x, [row]).token_ids[0] for _ in range(12)]

    for a, b in ((0, 1 << 32), (7, 7 + (30 << 32)), (-1, (1 << 63) - 1)):
        assert draws(a) != draws(b)
    assert draws(1 << 32) == draws(1 << 32)


def test_logit_bias_bans_and_forces_tokens_and_leaves_the_logprobs_raw():
    x = _logits(3, n=2)
    top = int(x[0].argmax())
    banned = Row(SamplingParams(temperature=0, logit_bias={top: -100.0}, logprobs=1))
    forced = Row(SamplingParams(temperature=1.0, seed=1, logit_bias={"7": 100}))
    out = Sampler().sample(x, [banned, forced])
    assert out.token_ids[0] == int(x[0].clone().index_fill_(0, torch.tensor([top]), -1e9).argmax())
    assert out.token_ids[1] == 7
    assert out.logprobs[0]["top"][0][0] == top  # the raw distribution's best, bias or not


def test_logit_bias_survives_the_ipc_form_and_names_bad_entries():
    sp = SamplingParams(logit_bias={"5": 1.5, 9: -100})
    assert sp.logit_bias == {5: 1.5, 9: -100} and SamplingParams.from_dict(sp.to_dict()).logit_bias == sp.logit_bias
    assert all(isinstance(k, str) for k in sp.to_dict()["logit_bias"])  # msgpack maps: string keys
    for bad, msg in (({"x": 1}, "'x' is not a token id"), ({5: 101}, "logit_bias: 101 out of range"),
                     ({-1: 1}, "logit_bias: -1 out of range"), ([1], "must be a map")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(logit_bias=bad)


def test_temperature_sampling_follows_the_softmax():
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5] + [-30.0] * (V - 5)])
    sp = SamplingParams(temperature=0.8, seed=0)
    row, s = Row(sp), Sampler()
    counts = torch.bincount(torch.tensor([s.sample(x, [row]).token_ids[0] for _ in range(4000)]), minlength=V)
    p = torch.softmax(x[0] / 0.8, -1)
    assert torch.allclose(counts.float() / 4000, p, atol=0.03)


def test_top_k_top_p_and_min_p_only_ever_sample_allowed_tokens():
    x = _logits(3)
    p = torch.softmax(x[0], -1)
    order = p.argsort(descending=True).tolist()
    cum = p[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1])
    cases = {
        "top_k": (SamplingParams(top_k=3, seed=1), set(order[:3])),
        "top_p": (SamplingParams(top_p=0.6, seed=2), nucleus),
        "min_p": (SamplingParams(min_p=0.3, seed=3), {i for i in range(V) if p[i] >= 0.3 * p.max()}),
    }
    s = Sampler()
    for name, (sp, allowed) in cases.items():
        row = Row(sp)
        seen = {s.sample(x, [row]).token_ids[0] for _ in range(400)}
        assert seen <= allowed, name
        assert len(seen) == len(allowed), name  # and every allowed token shows up


def test_suppressed_tokens_are_never_sampled():
    x = _logits(4)
    top = int(x.argmax())
    out = Sampler().sample(x, [Row(SamplingParams(temperature=0), suppressed_token_ids=(top,))])
    assert out.token_ids[0] != top


def test_penalties_follow_vllm_semantics():
    x = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    row = Row(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              prompt_token_ids=[1], output_token_ids=[2, 2])
    y = apply_penalties(x.clone(), [row])
    # token 0 unseen; 1 seen in prompt (negative -> *2); 2 seen twice in output (/2, then -0.5*2 - 0.25)
    assert torch.allclose(y, torch.tensor([[2.0, -4.0, 0.5 - 1.0 - 0.25, 1.0]]))


def test_logprobs_are_the_raw_distribution_with_top_n_sorted():
    x = _logits(5, 2)
    rows = [Row(SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5), output_token_ids=[0]),
            Row(SamplingParams(temperature=0, logprobs=0))]
    out = Sampler().sample(x, rows)
    lp = torch.log_softmax(x, -1)
    for i, d in enumerate(out.logprobs):
        tok = out.token_ids[i]
        assert abs(d["logprob"] - float(lp[i, tok])) < 1e-6
    top = out.logprobs[0]["top"]
    assert [t for t, _ in top] == lp[0].topk(3).indices.tolist()
    assert out.logprobs[1]["top"] == []


def test_rows_without_logprobs_get_none():
    out = Sampler().sample(_logits(6, 2), [Row(SamplingParams(temperature=0)), Row(SamplingParams(logprobs=1))])
    assert out.logprobs[0] is None and out.logprobs[1] is not None


class _BanFirstHalf:
    """A grammar state whose bitmask allows tokens V/2.. only."""

    active, vocab_size = True, V

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = -(1 << (V // 2))  # V = 32, one int32 word: bits V/2..31 set

    def observe(self, token: int) -> None:
        pass


@pytest.mark.parametrize("kind", ["greedy", "bias", "suppress", "penalties", "grammar", "seeded", "filters",
                                  "logprobs", "mixed"])
def test_bf16_logits_sample_as_their_float32_copy(kind):
    """The lm_head hands the sampler bf16 logits (no float copy in the step): a batch of plain greedy rows takes
    the argmax of the bf16 values, every other step turns them to float32 first, so tokens and logprobs equal
    the float32 copy's bit for bit, near-ties in bf16 included."""
    x = (_logits(11, 6) * 4).bfloat16()
    x[0, 3] = x[0, 5] = x[0].max()  # an exact bf16 tie: the first index wins on both
    sps = {"greedy": [SamplingParams(temperature=0)] * 6,
           "bias": [SamplingParams(temperature=0, logit_bias={3: -100.0, 7: 0.01})] * 6,
           "suppress": [SamplingParams(temperature=0)] * 6,
           "penalties": [SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.7)] * 6,
           "grammar": [SamplingParams(temperature=0)] * 6,
           "seeded": [SamplingParams(temperature=0.9, seed=j) for j in range(6)],
           "filters": [SamplingParams(temperature=1.1, top_k=5, top_p=0.8, min_p=0.05, seed=7 + j) for j in range(6)],
           "logprobs": [SamplingParams(temperature=0, logprobs=4)] * 6,
           "mixed": [SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=3),
                     SamplingParams(temperature=0, logprobs=2), SamplingParams(frequency_penalty=0.5, seed=1),
                     SamplingParams(temperature=0, logit_bias={0: 5.0}), SamplingParams(temperature=0)]}[kind]

    def rows() -> list:
        out = [Row(sp, output_token_ids=[3, 5, 5]) for sp in sps]
        for j, r in enumerate(out):
            if kind == "suppress" or (kind == "mixed" and j == 5):
                r.suppressed_token_ids = (int(x[j].argmax()),)
            if kind == "grammar":
                r.grammar = _BanFirstHalf()
        return out

    a, b = Sampler(seed=5).sample(x, rows()), Sampler(seed=5).sample(x.float(), rows())
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    if kind == "greedy":
        assert a.token_ids[0] == 3 and a.token_ids == x.float().argmax(-1).tolist()
    if kind == "grammar":
        assert all(t >= V // 2 for t in a.token_ids)


def test_steps_that_change_bf16_logits_compute_in_float32():
    """Rows where the step's arithmetic in bf16 would flip the token (bf16's step is 0.0625 at 10): a penalty
    (10 / 1.3 = 7.6923 rounds to 7.6875, tying the unseen 7.6875 ahead of it), a bias (10 + 0.03 rounds back to 10,
    tying the unbiased 10 ahead of it), and temperature draws (2,000 seeded rows)."""
    x = torch.full((2, V), -5.0)
    x[0, 2], x[0, 9] = 7.6875, 10.0
    x[1, 2], x[1, 9] = 10.0, 10.0
    x = x.bfloat16()
    rows = [Row(SamplingParams(temperature=0, repetition_penalty=1.3), prompt_token_ids=[9]),
            Row(SamplingParams(temperature=0, logit_bias={9: 0.03}))]
    for i, row in enumerate(rows):  # apart: a batch's bias turns every row to float32 before its penalties
        assert Sampler().sample(x[i:i + 1], [row]).token_ids == [9] == Sampler().sample(x[i:i + 1].float(),
                                                                                          [row]).token_ids
    many = (torch.randn(2000, V, generator=torch.Generator().manual_seed(1)) * 3).bfloat16()
    draws = [Sampler().sample(logits, [Row(SamplingParams(temperature=0.7, seed=i)) for i in range(2000)]).token_ids
             for logits in (many, many.float())]
    assert draws[0] == draws[1]


def _rows_of(sp: SamplingParams, n: int, **kw) -> list[Row]:
    return [Row(sp.for_sample(i) if sp.seed is not None else sp, **kw) for i in range(n)]


def _check_limit(x: torch.Tensor, rows: list[Row], want: int) -> None:
    """Every row samples `want`, with the raw model's (finite) logprob; the penalised logits hold no NaN or +inf,
    and -inf only where the input had it (a masked token stays masked, nothing else is dropped by overflow)."""
    x = x.expand(len(rows), -1)
    masked = x.clone()
    for i, r in enumerate(rows):
        masked[i, list(r.suppressed_token_ids)] = float("-inf")
    y = apply_penalties(masked.clone(), rows)
    assert not y.isnan().any() and not y.isposinf().any()
    assert torch.equal(y.isneginf(), masked.isneginf())
    out = Sampler(seed=3).sample(x, rows)
    assert out.token_ids == [want] * len(rows)
    raw = float(torch.log_softmax(x[0], -1)[want])
    assert all(math.isfinite(d["logprob"]) and abs(d["logprob"] - raw) < 1e-6 for d in out.logprobs)


@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0, 2.0])
@pytest.mark.parametrize("r", [1e-308, 1e-40, 1e-35])
def test_a_vanishing_repetition_penalty_makes_the_best_seen_positive_token_certain(r, temperature):
    """r -> 0 sends every seen positive logit x / r to +inf in their order, so the best of them is the limit's only
    token, under greedy and sampling alike. In float32 1e-308 is 0 (x / 0 = inf; a masked seen token's -inf * 0 =
    NaN, which argmax picks), 1e-40 overflows every seen positive to inf (ties, a NaN softmax), and 1e-35 overflows
    once divided by the temperature."""
    x = torch.full((1, V), -3.0)
    x[0, [0, 1, 4, 7, 9, 12]] = torch.tensor([0.0, 1.0, 2.0, -1.0, 3.5, 6.0])  # 12: the best, unseen
    sp = SamplingParams(temperature=temperature, repetition_penalty=r, seed=5, logprobs=1)
    _check_limit(x, _rows_of(sp, 8, prompt_token_ids=[1, 4, 0, 7], output_token_ids=[9],
                             suppressed_token_ids=(0,)), want=9)


@pytest.mark.parametrize("r", [1e-308, 1e-25, 0.5])
def test_a_seen_infinite_logit_stays_the_only_token_under_any_penalty(r):
    """A +inf logit (a model's overflow) that was seen stays +inf: scaled by the largest *finite* seen positive (the
    vanishing-penalty path divided every seen positive by inf / 1e30: +inf / inf = NaN, which argmax answers)."""
    x = torch.full((1, V), -1.0)
    x[0, [2, 5, 10]] = torch.tensor([float("inf"), 4.0, 7.0])
    rows = _rows_of(SamplingParams(temperature=0, repetition_penalty=r), 1, prompt_token_ids=[2, 5])
    y = apply_penalties(x.clone(), rows)
    assert not y.isnan().any() and y[0, 2] == float("inf")
    assert Sampler(seed=1).sample(x, rows).token_ids == [2]


@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
@pytest.mark.parametrize("r", [1e37, 1e39, 1e308])
def test_a_huge_repetition_penalty_keeps_the_order_of_the_seen_negative_logits(r, temperature):
    """r -> inf sends every seen negative logit x * r to -inf; where every token was seen (the masked one aside),
    the least negative stays the only token of the limit. In float32 1e39 and 1e308 are inf: every x * r ties at
    -inf (argmax answers the masked token 0, softmax NaN); 1e37 overflows once divided by the temperature."""
    x = -torch.linspace(1.0, 9.0, V).unsqueeze(0)
    x[0, 5] = -0.5
    sp = SamplingParams(temperature=temperature, repetition_penalty=r, seed=5, logprobs=1)
    _check_limit(x, _rows_of(sp, 8, prompt_token_ids=list(range(V)), suppressed_token_ids=(0,)), want=5)


@pytest.mark.parametrize("r", [1e39, 1e308])
def test_a_huge_repetition_penalty_leaves_a_seen_zero_logit_at_zero(r):
    """0 * r stays 0 (not 0 * inf = NaN, which argmax would answer): the unseen 0.5 wins."""
    x = torch.full((1, V), -2.0)
    x[0, 3], x[0, 8] = 0.0, 0.5
    sp = SamplingParams(temperature=0, repetition_penalty=r, logprobs=0)
    _check_limit(x, _rows_of(sp, 1, prompt_token_ids=[3, 1]), want=8)


@pytest.mark.parametrize("r", [1e-20, 0.3, 0.77, 1.3, 7.0, 1e20])
def test_ordinary_repetition_penalties_keep_the_plain_arithmetic_bit_for_bit(r):
    x = _logits(8, 1) * 10
    x[0, 2], x[0, 6], x[0, 11] = 0.0, float("-inf"), -0.0
    seen = torch.zeros(V, dtype=torch.bool)
    seen[::3] = True
    xi = x[0]
    plain = torch.where(seen, torch.where(xi > 0, xi / r, xi * r), xi)
    y = apply_penalties(x.clone(), [Row(SamplingParams(repetition_penalty=r), prompt_token_ids=list(range(0, V, 3)))])
    assert torch.equal(y[0], plain) and torch.equal(y[0].signbit(), plain.signbit())


def test_a_tiny_temperature_is_greedy():
    x = _logits(9, 1)
    rows = _rows_of(SamplingParams(temperature=1e-30, seed=1), 6)
    assert Sampler().sample(x.expand(6, -1), rows).token_ids == [int(x.argmax())] * 6


@pytest.mark.parametrize("temperature", [1e39, 1e300])
def test_a_temperature_past_float32_samples_uniformly_among_allowed_tokens(temperature):
    """temperature -> inf flattens the distribution over the tokens left; in float32 1e39 is inf and a masked
    token's -inf / inf is NaN, which made every draw token 0, the masked one."""
    x = _logits(10, 1)
    rows = _rows_of(SamplingParams(temperature=temperature, seed=1), 400, suppressed_token_ids=(0,))
    drawn = torch.tensor(Sampler().sample(x.expand(400, -1), rows).token_ids)
    assert 0 not in drawn.tolist()
    counts = torch.bincount(drawn, minlength=V)[1:]
    assert counts.min() >= 2 and counts.max() <= 35  # 400 draws over 31 tokens: about 13 each


def test_the_edges_of_top_p_and_min_p_keep_only_the_best_token():
    x = _logits(12, 1)
    for sp in (SamplingParams(top_p=1e-300, seed=1), SamplingParams(min_p=1.0, seed=1),
               SamplingParams(top_p=5e-324, min_p=1.0, top_k=1, temperature=2.0, seed=1)):
        assert Sampler().sample(x.expand(6, -1), _rows_of(sp, 6)).token_ids == [int(x.argmax())] * 6
