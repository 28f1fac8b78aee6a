"""The engine on the real glm-5.3-tiny checkpoint (reference PyTorch on the CPU; index_topk 8, so prompts
longer than 32 tokens really are sparse): batching, chunking, prefix caching, preemption and seeds
change nothing, and greedy output equals HF transformers'.

Layouts: the HF comparison uses the `fp32` KV layout (the pool's exact reference mode). On this
random-weight checkpoint, rounding the KV to bf16 already moves logits by up to ~9 (logit std 4,
median top-1 margin ~1) and flips greedy tokens against HF's float32 cache; the same numbers come out of
the model runner without the engine (measured 28/40 first tokens agree fp32 vs bf16, 15/40 fp8 vs bf16).
So layout-vs-layout checks use the tolerances documented in the fp8 test, and every "engine changes
nothing" check compares runs of the same layout.

Greedy equality is checked as vLLM's `check_logprobs_close` does: different batch shapes (batched vs
alone, chunked vs whole, recompute after preemption, our kernels vs HF's) round differently in the last
bits, and on this checkpoint that can flip a near-tie (seen on a 16-core host, never on the 2-core CI
machine). So tokens must be equal, except that a sequence may part at a near-tie — both picks within
NEAR_TIE nats of each other in both runs — and then is not compared further; at most a few may part.
"""

from __future__ import annotations

import random

import pytest
import torch

from dsaserve import Engine, SamplingParams
from dsaserve.model.forward_batch import contiguous_batch

MODEL = "glm-5.3-tiny"  # every Engine here runs on the CPU reference path, even on a GPU machine
GREEDY8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
NEAR_TIE = 0.05  # nats between the two candidates at a parting: rounding noise, not a wrong KV read


def top(lp: dict) -> dict[int, float]:
    return {t: v for t, v in lp["top"]}


def hf_run(ckpt, prompt: list[int], n: int) -> tuple[list[int], list[dict[int, float]]]:
    from dsaserve.quality.hf_oracle import hf_greedy_logits

    ids, logits = hf_greedy_logits(ckpt, prompt, n)
    tops = []
    for row in logits:
        v, i = torch.log_softmax(row.float(), -1).topk(5)
        tops.append(dict(zip(i.tolist(), v.tolist(), strict=True)))
    return ids, tops


def greedy_close(ref: tuple[list[int], list[dict]], got: tuple[list[int], list[dict]], what: str,
                 near_tie: float | None = None) -> bool:
    """True if identical; False if they part at a near-tie (asserted, within `near_tie` nats: NEAR_TIE by
    default); fails otherwise."""
    near_tie = NEAR_TIE if near_tie is None else near_tie
    (a_ids, a_top), (b_ids, b_top) = ref, got
    assert len(a_ids) == len(b_ids), what
    for i, (a, b) in enumerate(zip(a_ids, b_ids, strict=True)):
        if a != b:
            ta, tb = a_top[i], b_top[i]
            assert b in ta and a in tb, f"{what}: token {i} {a} vs {b}, not in each other's top-5"
            assert abs(ta[a] - ta[b]) < near_tie and abs(tb[a] - tb[b]) < near_tie, \
                f"{what}: token {i} {a} vs {b} parted without a near-tie: {ta} / {tb}"
            return False
    return True


def outputs(outs) -> list[tuple[list[int], list[dict]]]:
    return [(o.token_ids, [top(lp) for lp in o.logprobs]) for o in outs]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(MODEL)


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(2, 512) for _ in range(r.randrange(lo, hi + 1))] for _ in range(n)]


def capture_logits(eng: Engine) -> dict[str, list[torch.Tensor]]:
    """request_id -> the logits rows it sampled from, in order (wraps schedule and forward)."""
    got: dict[str, list[torch.Tensor]] = {}
    owners: list[list[str]] = []
    schedule, forward = eng.core.scheduler.schedule, eng.core.runner.forward

    def sched():
        s = schedule()
        owners.append([r.request_id for r in s.logit_reqs] if s else [])
        return s

    def fwd(batch):
        logits = forward(batch)
        for rid, row in zip(owners[-1], logits, strict=True):
            got.setdefault(rid, []).append(row)
        return logits

    eng.core.scheduler.schedule, eng.core.runner.forward = sched, fwd
    return got


def over_time(eng: Engine, ps: list[list[int]], params: SamplingParams, per_step: int = 3) -> list:
    """Requests arrive a few per step while the earlier ones prefill and decode."""
    rids, done = [], {}
    for i in range(0, len(ps), per_step):
        rids += [eng.add_request(p, params) for p in ps[i:i + per_step]]
        done.update({o.request_id: o for o in eng.step() if o.finished})
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[r] for r in rids]


def test_forty_requests_arriving_over_time_equal_each_alone_and_hf_greedy(ckpt):
    ps = prompts(42, 1, 120, seed=0)
    assert sum(len(p) > 32 for p in ps) >= 20  # most are past 4 x index_topk: the indexer selects
    for layout in ("bf16", "fp32"):
        eng = Engine(MODEL, device="cpu", kv_layout=layout, num_pages=64, max_num_batched_tokens=256,
                     chunked_prefill_size=64, max_running_requests=32)
        batched = outputs(over_time(eng, ps, GREEDY8))
        eng.core.check_no_leak()
        if layout == "bf16":
            alone = Engine(MODEL, device="cpu", kv_layout=layout, num_pages=64, enable_prefix_caching=False)
            ref = [outputs(alone.generate([p], GREEDY8))[0] for p in ps]
        else:
            ref = [hf_run(ckpt, p, 8) for p in ps]
        same = [greedy_close(r, b, f"{layout} request {i}") for i, (r, b) in enumerate(zip(ref, batched, strict=True))]
        assert sum(same) >= len(ps) - 4, f"{layout}: {len(ps) - sum(same)} sequences parted at near-ties"


def test_chunks_smaller_than_index_topk_equal_unchunked_prefill():
    ps = [prompts(1, 100, 100, seed=1)[0], prompts(1, 45, 45, seed=2)[0]]
    runs = []
    for chunk in (3, 2048):
        eng = Engine(MODEL, device="cpu", kv_layout="fp32", num_pages=16, max_num_batched_tokens=max(chunk, 16),
                     chunked_prefill_size=chunk)
        logits = capture_logits(eng)
        outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5))
        runs.append((outputs(outs), [logits[o.request_id][0] for o in outs], eng.core.stats()["steps"]))
    (out_a, first_a, steps_a), (out_b, first_b, steps_b) = runs
    assert steps_a > 34 and steps_b == 4  # the 100-token prompt really took 34 chunks of 3
    for i, (a, b) in enumerate(zip(out_a, out_b, strict=True)):
        assert greedy_close(b, a, f"prompt {i}")
    for a, b in zip(first_a, first_b, strict=True):  # the logits at the end of the prompt
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)


def test_prefix_cache_hit_equals_a_miss_and_computes_only_the_suffix():
    shared = prompts(1, 150, 150, seed=3)[0]
    p2 = shared + prompts(1, 10, 10, seed=4)[0]
    miss = Engine(MODEL, device="cpu", kv_layout="bf16", num_pages=16, enable_prefix_caching=False)
    expect = outputs(miss.generate([p2], GREEDY8))[0]
    eng = Engine(MODEL, device="cpu", kv_layout="bf16", num_pages=16)
    eng.generate([shared], SamplingParams(temperature=0, max_tokens=2))
    before = eng.core.stats()["computed_tokens"]
    out = eng.generate([p2], GREEDY8)[0]
    assert greedy_close(expect, outputs([out])[0], "hit vs miss")
    assert out.num_cached_tokens == 128  # two full pages of the 150 shared tokens
    assert eng.core.stats()["computed_tokens"] - before == len(p2) - 128 + 8 - 1
    eng.core.check_no_leak()


def test_tiny_pool_preempts_aborts_and_still_matches_running_alone():
    ps = prompts(6, 50, 70, seed=5)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=5)
    ref = Engine(MODEL, device="cpu", kv_layout="bf16", num_pages=16, enable_prefix_caching=False)
    expect = [outputs(ref.generate([p], params))[0] for p in ps]
    eng = Engine(MODEL, device="cpu", kv_layout="bf16", num_pages=3, max_num_batched_tokens=64, chunked_prefill_size=32)
    rids = [eng.add_request(p, params) for p in ps]
    victim = eng.add_request(prompts(1, 90, 90, seed=6)[0], params)
    done: dict = {}
    for step in range(5000):
        if not eng.has_unfinished():
            break
        if step == 2:
            eng.abort(victim)  # mid-prefill or waiting
        done.update({o.request_id: o for o in eng.step() if o.finished})
    same = [greedy_close(e, outputs([done[r]])[0], f"request {i}") for i, (e, r) in enumerate(zip(expect, rids,
                                                                                                    strict=True))]
    assert sum(same) >= len(ps) - 1
    assert done[victim].finish_reason == "abort"
    assert eng.core.stats()["preemptions"] > 0
    eng.core.check_no_leak()


def test_a_seed_gives_the_same_tokens_whatever_else_is_in_the_batch():
    p = prompts(1, 40, 40, seed=7)[0]
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)
    eng = Engine(MODEL, device="cpu", kv_layout="bf16", num_pages=32)
    alone = eng.generate([p], sp)[0].token_ids
    company = prompts(5, 5, 80, seed=8)
    others = [SamplingParams(temperature=0, max_tokens=5), SamplingParams(temperature=1.2, max_tokens=9),
              SamplingParams(top_k=5, seed=9, max_tokens=3), SamplingParams(max_tokens=12),
              SamplingParams(repetition_penalty=1.2, max_tokens=7)]
    outs = eng.generate(company[:2] + [p] + company[2:], others[:2] + [sp] + others[2:])
    assert outs[2].token_ids == alone


def test_fp8_kv_through_the_engine_adds_no_error_and_stays_near_bf16():
    """Tolerances, documented (this random checkpoint; see the module docstring):
    - fp8_ds_mla vs bf16 first-step logits, both batched and chunked: median centred cosine 0.85 and
      15/40 equal argmaxes (chance: 1/512), the same on the 2-core CI CPU and a 16-core Xeon. So: >= 10/40
      first tokens agree and median cosine >= 0.75; a broken scale or layout gives cosine ~0.
    - paging adds nothing: served one unchunked request per step (the runner's own GEMM shapes), the
      engine's paged fp8 logits equal the runner's contiguous single-sequence forward to 1e-4. With other
      shapes (batched, chunked) an ulp-level latent difference can land on the other side of an FP8
      rounding boundary, a whole FP8 step that this checkpoint amplifies (up to ~1 logit on some rows, by
      CPU); that invariance is pinned in the fp32 layout instead (chunked-prefill and forty-request tests).
    """
    ps = prompts(40, 1, 120, seed=0)
    first: dict[str, torch.Tensor] = {}
    for name, layout, kw in (("bf16", "bf16", {"max_num_batched_tokens": 512, "chunked_prefill_size": 48}),
                             ("fp8", "fp8_ds_mla", {"max_num_batched_tokens": 512, "chunked_prefill_size": 48}),
                             ("fp8_serial", "fp8_ds_mla", {"max_num_batched_tokens": 128, "max_running_requests": 1,
                                                           "num_pages": 8})):
        eng = Engine(MODEL, device="cpu", kv_layout=layout, **{"num_pages": 64, **kw})
        logits = capture_logits(eng)
        outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=1))
        first[name] = torch.stack([logits[o.request_id][0] for o in outs])
    assert eng.core.stats()["evicted_pages"] > 0  # the serial run reused pages: its page tables were not trivial
    runner = eng.core.runner  # its own forward, unwrapped; the engine is done with the pool
    direct = torch.cat([type(runner).forward(runner, contiguous_batch([q], [0], [0])) for q in ps])
    torch.testing.assert_close(first["fp8_serial"], direct, rtol=1e-4, atol=1e-4)
    a, b = first["fp8"], first["bf16"]
    agree = int((a.argmax(-1) == b.argmax(-1)).sum())
    assert agree >= 10, agree
    assert float(cosine(a, b).median()) >= 0.75, cosine(a, b)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row cosine of the centred logits (softmax does not see a row's mean)."""
    ca, cb = a - a.mean(-1, keepdim=True), b - b.mean(-1, keepdim=True)
    return (ca * cb).sum(-1) / (ca.norm(dim=-1) * cb.norm(dim=-1))


def test_kv_pool_info_is_the_runner_pool_at_its_final_size():
    eng = Engine(MODEL, device="cpu", kv_layout="bf16", num_pages=16)
    info = eng.kv_pool_info()
    assert (info.layout, info.num_pages, info.num_tokens) == ("bf16", 16, 16 * info.page_size)
    assert info == eng.core.runner.kv_pool.info()
    assert info.bytes_per_token == (info.kv_bytes_per_token_per_layer * info.kv_layers
                                    + info.indexer_bytes_per_token_per_layer * info.indexer_layers)
    assert info.total_bytes == info.bytes_per_token * info.num_tokens
