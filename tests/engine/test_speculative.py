"""Speculative decoding with the MTP layer (engine/mtp.py) on the trained built-in glm-5.3-mini, CPU reference path:
drafts change no output (greedy, with penalties, chunked, prefix-cached, preempted, stop tokens, max_tokens at
every boundary, grammars beside), seeded sampling keeps its draws, the drafts are exactly the MTP layer's over the
finished sequence, and the flags refuse what is not built."""

from __future__ import annotations

import json

import pytest
import torch

from dsaserve import Engine, SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.model.forward_batch import contiguous_batch
from tests.engine.test_engine_real_model import greedy_close, outputs, over_time, prompts

MODEL = "glm-5.3-mini"
TEXTS = ["The quick brown fox", "def fibonacci(n):", "A language model reads a sequence of tokens",
         "Sparse attention selects", "import json\n\ndata = {"]


def _engine(spec: bool, steps: int = 1, **kw) -> Engine:
    spec_kw = {"speculative_algorithm": "mtp", "speculative_num_steps": steps} if spec else {}
    return Engine(MODEL, device="cpu", **spec_kw, **{"num_pages": 64, **kw})


def _both(params: SamplingParams, texts=TEXTS, steps: int = 1, **kw) -> tuple[list, list, dict]:
    """(the plain engine's outputs, the drafting engine's, its stats); the drafting engine leaks nothing."""
    base = _engine(False, **kw).generate(texts, params)
    eng = _engine(True, steps, **kw)
    spec = eng.generate(texts, params)
    eng.core.check_no_leak()
    return base, spec, eng.core.stats()


def _same(base, spec) -> None:
    """Greedy equality, parting only at near-ties (tests/engine/test_engine_real_model.py's rule; the requests
    ask logprobs for it)."""
    same = [greedy_close(b, s, f"request {i}") for i, (b, s) in enumerate(zip(outputs(base), outputs(spec),
                                                                                strict=True))]
    assert sum(same) >= len(same) - 1


@pytest.mark.parametrize("steps", [1, 3])
def test_greedy_outputs_and_logprobs_are_those_without_drafts_in_fewer_steps(steps):
    """fp32 KV: a step of several tokens reads its own rows exactly where a one-token step reads them back from the
    FP8 cache (~1e-3 nats apart over a few steps), so only the exact layout compares logprobs this closely."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=3)
    base, spec, stats = _both(params, steps=steps, kv_layout="fp32")
    _same(base, spec)
    for b, s in zip(base, spec, strict=True):
        if b.token_ids == s.token_ids:  # the kept drafts' tokens carry their own position's logprobs
            torch.testing.assert_close([lp["logprob"] for lp in s.logprobs], [lp["logprob"] for lp in b.logprobs],
                                       rtol=1e-4, atol=1e-4)
    assert stats["spec_accepted_tokens"] >= 0.25 * stats["spec_draft_tokens"] > 0
    assert stats["steps"] < 40  # the plain engine's: one token a request a step
    assert stats["generation_tokens"] == 40 * len(TEXTS)


def test_the_drafts_are_the_mtp_layers_argmax_over_the_finished_sequence():
    """Replaying each finished greedy sequence through the main model and the MTP layer in one forward gives the
    drafts the engine verified, and so exactly its kept count (its MTP KV was written at the right slots from the
    right tokens and hidden rows; a draft not kept never fed it)."""
    eng = _engine(True)
    outs = eng.generate(TEXTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    runner, drafted, kept = eng.core.runner, 0, 0
    for o in outs:
        seq, p = o.prompt_token_ids + o.token_ids, len(o.prompt_token_ids)
        b = contiguous_batch([seq], [0], [0])
        b.logits_indices = torch.arange(len(seq))
        _, hidden = runner.model(b, runner.kv_pool)
        mb = contiguous_batch([seq[1:]], [0], [0])
        mb.logits_indices = torch.arange(len(seq) - 1)
        guess = runner.model.forward_mtp(mb, runner.kv_pool, hidden[:-1]).argmax(-1).tolist()
        i, known = p - 1, p + 1  # the draft made at position i guesses token i + 2
        while known + 2 <= p + 30:
            drafted += 1
            step = 2 if guess[i] == seq[i + 2] else 1
            kept += step == 2
            i, known = i + step, known + step
    stats = eng.core.stats()
    assert (stats["spec_draft_tokens"], stats["spec_accepted_tokens"]) == (drafted, kept)
    assert stats["spec_num_drafts"] == drafted and stats["spec_accepted_per_pos"] == [kept]  # one draft a step


def test_drafts_kept_by_position_count_each_request_steps_run_of_kept_drafts():
    """With 3 drafts a draft is kept only after the ones before it: the per-position counts fall, add up to the
    kept drafts, and each request-step that verified drafts (spec_num_drafts) keeps at most one at each position."""
    eng = _engine(True, 3)
    eng.generate(TEXTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    s = eng.core.stats()
    per = s["spec_accepted_per_pos"]
    assert len(per) == 3 and sum(per) == s["spec_accepted_tokens"] > 0
    assert s["spec_num_drafts"] >= per[0] >= per[1] >= per[2] > 0
    assert s["spec_num_drafts"] < s["spec_draft_tokens"] <= 3 * s["spec_num_drafts"]


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 9])
def test_max_tokens_at_every_boundary(max_tokens, steps):
    """A verify step may give one token more than it has drafts: never past max_tokens, and only as many drafts as
    fit."""
    base, spec, _ = _both(SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2), TEXTS[:3],
                          steps)
    _same(base, spec)
    assert all(len(o.token_ids) == max_tokens and o.finish_reason == "length" for o in spec)


@pytest.mark.parametrize("steps", [1, 3])
def test_a_stop_token_ends_a_request_inside_a_verify_step(steps):
    """Each request's stop token is one it emits mid-way (its 5th / 6th / 7th greedy token), so some stops come
    as a kept draft and some as the token after it: the token after a stop is never emitted."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = _engine(False).generate(TEXTS, greedy)
    for k in (4, 5, 6):
        stops = sorted({o.token_ids[k] for o in plain})
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=stops, logprobs=2)
        base, spec, _ = _both(params, steps=steps)
        _same(base, spec)
        assert all(o.finish_reason == "stop" and o.token_ids[-1] in stops for o in spec if len(o.token_ids) < 24)


@pytest.mark.parametrize("steps", [1, 3])
def test_penalties_and_min_tokens_see_the_draft_in_its_row(steps):
    """A draft's row is sampled as if the drafts up to it were output already: a repetition / frequency penalty
    and min_tokens there give what the plain engine gives steps later."""
    params = SamplingParams(temperature=0, max_tokens=32, repetition_penalty=1.4, frequency_penalty=0.6,
                            presence_penalty=0.3, min_tokens=20, logprobs=2)
    base, spec, stats = _both(params, steps=steps)
    _same(base, spec)
    assert stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("steps", [1, 3])
def test_chunked_prefill_prefix_cache_and_preemption_change_nothing(steps):
    """Prompts prefilled in chunks of 16 (the MTP layer extends over each chunk), arriving over time, sharing
    prefixes (their pages, MTP KV included, from the prefix cache) in a pool small enough to preempt."""
    ps = [p + q for p in prompts(3, 40, 90, seed=3) for q in prompts(3, 5, 30, seed=4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    kw = dict(num_pages=9, max_num_batched_tokens=64, chunked_prefill_size=16, max_running_requests=8)
    base = outputs(over_time(_engine(False, num_pages=64), ps, params))
    eng = _engine(True, steps, **kw)
    spec = outputs(over_time(eng, ps, params))
    eng.core.check_no_leak()
    stats = eng.core.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0 and stats["spec_accepted_tokens"] > 0
    same = [greedy_close(b, s, f"request {i}") for i, (b, s) in enumerate(zip(base, spec, strict=True))]
    assert sum(same) >= len(same) - 1


def test_seeded_samples_keep_their_draws_until_a_draft_is_not_kept():
    """A seed draws r0 then r1 from its own stream, as the plain engine draws those two positions one step
    apart: every request's second token equals the plain engine's, and its third wherever its draft was kept
    (max_tokens 3: one verify step a request, so the kept count is the requests whose draft was kept)."""
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=3, seed=s, ignore_eos=True) for s in range(40)]
    texts = [TEXTS[s % 2] for s in range(40)]
    base, spec, stats = _both(params, texts)
    assert [o.token_ids[:2] for o in base] == [o.token_ids[:2] for o in spec]
    third = sum(b.token_ids == s.token_ids for b, s in zip(base, spec, strict=True))
    assert stats["spec_draft_tokens"] == 40 and third >= stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("steps", [1, 3])
def test_n_samples_fork_and_draft_on_their_own(steps):
    """n = 3 seeded samples: the followers fork from the leader's prompt and draft after their own first step;
    each sample's tokens up to its first verify step's own draw equal the plain engine's (the leader's first
    two, a follower's first three: one more step of its own before its first draft)."""
    params = SamplingParams(temperature=0.9, max_tokens=12, seed=7, n=3, ignore_eos=True)
    base, spec, stats = _both(params, TEXTS[:2], steps)
    for b, s in zip(base, spec, strict=True):
        for i, (bo, so) in enumerate(zip(b.outputs, s.outputs, strict=True)):
            k = 2 if i == 0 else 3
            assert bo.token_ids[:k] == so.token_ids[:k] and len(so.token_ids) == 12
    assert stats["spec_draft_tokens"] >= 6 and stats["generation_tokens"] == 2 * 3 * 12


@pytest.mark.parametrize("steps", [1, 3])
def test_structured_output_requests_draft_under_their_grammar(steps):
    """A constrained request's draft rows are masked as if the drafts before them were taken, and its kept draws
    are taken in order: greedy outputs equal plain decoding's (valid JSON, a regex, free text beside), with drafts
    verified and kept for the constrained requests alone too."""
    from dsaserve.engine.grammar import make_spec

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "a": {"type": "integer", "maximum": 999}}, "required": ["name", "a"]}
    specs = [make_spec("json_schema", schema), make_spec("regex", "(def|class) [a-z_]{2,12}\\(\\):")]
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=sp.to_dict()) for sp in specs]
    params.append(SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    runs, stats = [], []
    for spec in (False, True):
        eng = _engine(spec, steps=steps)
        rids = [eng.add_request(t, params[i % 3]) for i, t in enumerate(TEXTS * 2)]
        done = {}
        while eng.has_unfinished():
            done.update({o.request_id: o for o in eng.step() if o.finished})
        eng.core.check_no_leak()
        runs.append([done[r] for r in rids])
        stats.append(eng.core.stats())
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert runs[1][0].finish_reason == "stop" and set(json.loads(runs[1][0].text)) == {"name", "a"}
    assert stats[1]["spec_accepted_tokens"] > 0
    eng = _engine(True, steps=steps)  # constrained requests alone: their own drafts are verified and kept
    eng.generate(TEXTS[:2], params[0])
    assert eng.core.stats()["spec_accepted_tokens"] > 0


def test_an_abort_mid_generation_frees_everything():
    eng = _engine(True, steps=3)
    rids = [eng.add_request(t, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)) for t in TEXTS]
    for _ in range(6):
        eng.step()
    eng.abort(rids[1])
    while eng.has_unfinished():
        eng.step()
    eng.core.check_no_leak()


def test_the_flags_refuse_what_is_not_built():
    with pytest.raises(ValueError, match="--speculative-algorithm: steps synchronously"):
        EngineArgs(model=MODEL, speculative_algorithm="mtp", disable_overlap_schedule=False)
    with pytest.raises(ValueError, match="--speculative-algorithm: 'eagle' is not one of mtp, nextn"):
        EngineArgs(model=MODEL, speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="--speculative-num-steps: at most 8"):
        EngineArgs(model=MODEL, speculative_algorithm="mtp", speculative_num_steps=9)
    with pytest.raises(ValueError, match="--speculative-num-steps: must be a positive integer"):
        EngineArgs(model=MODEL, speculative_algorithm="mtp", speculative_num_steps=0)
    args = EngineArgs(model=MODEL, speculative_algorithm="nextn", device="cuda")
    assert args.loads_mtp and not args.overlap_schedule


def test_a_model_without_an_mtp_layer_is_refused_by_name():
    from dsaserve.engine.engine_core import EngineCore
    from tests.engine.fake_runner import FakeRunner

    with pytest.raises(ValueError, match="--speculative-algorithm: this model has no MTP layer"):
        EngineCore(EngineArgs(model=MODEL, speculative_algorithm="mtp"), runner=FakeRunner())


def test_the_draft_row_is_its_request_with_the_draft_output():
    """What the sampler reads of a draft's row r1: the request's outputs and the draft, min_tokens one output on,
    the request's own seeded generator; a penalty then moves r1 as the draft's output would."""
    from dsaserve.engine.mtp import DraftRow
    from dsaserve.engine.request import Req
    from dsaserve.model.sampler import Sampler

    req = Req("r", 0, [1, 2, 3], SamplingParams(temperature=0, presence_penalty=2.0, min_tokens=3), 0.0, 0, 100,
              frozenset({9}))
    req.tokens.append(5)
    row = DraftRow(req, [7])
    assert (row.output_token_ids, req.output_token_ids, row.prompt_token_ids) == ([5, 7], [5], [1, 2, 3])
    assert req.suppressed_token_ids == row.suppressed_token_ids == (9,)  # 1 and 2 outputs of 3
    req.tokens.append(6)
    assert (req.suppressed_token_ids, row.suppressed_token_ids) == ((9,), ())  # 2 outputs, the draft the 3rd
    logits = torch.zeros(2, 10)
    logits[:, 7], logits[:, 9], logits[:, 4] = 1.0, 0.8, 0.5
    assert Sampler().sample(logits, [req, row]).token_ids == [7, 9]  # r1: 7 was output (1 - 2), stop 9 allowed
    g = torch.Generator()
    row.generator = g
    assert req.generator is g and row.sampling is req.sampling and row.grammar is None


def test_the_warmup_runs_the_mtp_layer_at_the_core_shapes_on_the_sink_page():
    """What a GPU start runs before Up for a drafting engine's eager MTP forwards: the MTP layer at each
    attention-core shape of the plan and, without MTP graphs (whose captures run them), at each decode bucket's one
    token a request, writing only the sink page (here on the CPU, with a sink page)."""
    from dsaserve.engine.kv_pool import KVPool
    from dsaserve.engine.warmup import warm_mtp
    from dsaserve.engine.warmup_plan import WarmupPlan

    runner = _engine(True).core.runner
    model, cfg = runner.model, runner.cfg
    pool = KVPool(cfg, 4, runner.kv_pool.layout, model.kv_layer_ids, 64, model.dtype, "cpu", sink_pages=1)
    plan = WarmupPlan.build(4, [16, 64], 4, 64, cfg.index_topk)
    widths = {pages for _, pages in plan.class_shapes}
    assert warm_mtp(model, pool, plan, 256) == len(plan.core_shapes) + len(plan.decode) * len(widths)
    assert warm_mtp(model, pool, plan, 256, decode_rows=False) == len(plan.core_shapes)
    assert len(plan.core_shapes) > 3 and len(plan.decode) > 1 and widths
    mtp_kv = pool.kv_cache(cfg.mtp_layer_ids[0]).view(5, 64, -1)
    assert mtp_kv[4].any() and not mtp_kv[:4].any() and not pool.kv_buffer[0].any()


def test_drafts_stay_within_the_mixed_step_cap_and_never_preempt():
    """A step's drafts count as tokens against --mixed-step-tokens (8 requests with 4 drafts each and a long prompt
    arriving: no step past the cap of 32), and a request whose drafts would need pages another request holds
    decodes without them instead of preempting it (a pool of 3 pages: no more preemptions than plain decoding)."""
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    eng = _engine(True, 4, mixed_step_tokens=32)
    for t in TEXTS[:4] * 2:
        eng.add_request(t, greedy)
    for _ in range(3):
        eng.step()
    sizes, schedule = [], eng.core.scheduler.schedule

    def spy():
        s = schedule()
        sizes.append(s.num_tokens if s is not None else 0)
        return s

    eng.core.scheduler.schedule = spy
    eng.add_request([5] * 200, greedy)
    while eng.has_unfinished():
        eng.step()
    assert max(sizes) <= 32 and eng.core.stats()["spec_accepted_tokens"] > 0
    eng.core.check_no_leak()
    ps = [p for p in prompts(6, 20, 60, seed=5)]
    preempted = []
    for spec in (False, True):
        e = _engine(spec, 3, num_pages=3, max_num_batched_tokens=64, max_running_requests=4)
        over_time(e, ps, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        e.core.check_no_leak()
        preempted.append(e.core.stats()["preemptions"])
    assert preempted[1] <= preempted[0]


def test_the_kept_count_is_of_tokens_emitted():
    """A stop token kept as a draft ends the request: the drafts after it are not counted as kept (nor emitted)."""
    text = TEXTS[0]
    plain = _engine(False).generate([text], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    for i in range(2, 12):
        eng = _engine(True, 3)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[plain.token_ids[i]])
        eng.add_request(text, params)
        kept, emitted = 0, 0
        while eng.has_unfinished():
            for o in eng.step():
                kept += max(0, len(o.token_ids) - emitted - 1)  # a step's tokens past its first: kept drafts'
                emitted = len(o.token_ids)
        assert eng.core.stats()["spec_accepted_tokens"] == kept


def test_drafting_captures_decode_graphs_for_the_verify_rows():
    """A verify step replays the decode graphs as one token a row (forward_batch.as_decode_rows): by default they
    hold every running request's last token and drafts."""
    assert EngineArgs(model=MODEL, max_running_requests=16).graph_max_bs == 16
    assert EngineArgs(model=MODEL, max_running_requests=16, speculative_algorithm="mtp",
                      speculative_num_steps=3).graph_max_bs == 64
    assert EngineArgs(model=MODEL, max_running_requests=16, speculative_algorithm="mtp",
                      cuda_graph_max_bs=8).graph_max_bs == 8
    assert EngineArgs(model=MODEL, max_running_requests=16, speculative_algorithm="mtp", speculative_num_steps=3,
                      enable_dp_attention=True, expert_parallel_size=2).graph_max_bs == 16  # DP verifies eagerly


def test_the_next_step_is_launched_before_the_host_has_its_drafts():
    """The drafts stay on the device (engine/mtp.py `extend`): the next step's verify rows carry them as placeholder
    ids, each the index of its draft in the runner's `future_token_ids`, resolved there by the forward; their values
    reach the host (`materialize`) only after that forward is launched, for the sampler's rows and the kept test.
    Outputs stay plain decoding's (the tests above); here, that the placeholders are what the forward was given and
    stand for the drafts the host later holds."""
    eng = _engine(True, 3)
    core, forward, seen = eng.core, eng.core.runner.forward_with_hidden, []

    def spy(batch):
        ids = batch.input_ids.tolist()
        pending = core.mtp._pending is not None
        future = core.runner.future_token_ids.clone()
        out = forward(batch)
        seen.append((ids, batch.input_ids.tolist(), pending, future))
        return out

    core.runner.forward_with_hidden = spy
    materialize, left = core.mtp.materialize, []

    def checked():  # no placeholder outlives a materialize, in any request
        materialize()
        left.extend(d for r in [*core.scheduler.running, *core.scheduler.waiting] for d in r.drafts if d < 0)

    core.mtp.materialize = checked
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    _same(_engine(False).generate(TEXTS, params), eng.generate(TEXTS, params))
    verify = [(ids, resolved, pending, future) for ids, resolved, pending, future in seen if min(ids) < 0]
    assert len(verify) >= len(seen) // 2 and all(pending for *_, pending, _ in verify)
    for ids, resolved, _, future in verify:
        assert resolved == [future[-1 - i].item() if i < 0 else i for i in ids]  # resolved in place, on the device
    assert not left and core.mtp._pending is None
