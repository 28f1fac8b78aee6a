"""Prompt logprobs through the engine (engine/prompt_logprobs.py): against HF transformers on the same weights,
over chunked prefills and the overlap scheduler; with the prefix cache, n > 1 and a preemption in the middle."""

from __future__ import annotations

import pytest
import torch

from dsaserve import Engine, SamplingParams
from dsaserve.quality.hf_oracle import hf_model

ATOL = 2e-3  # the HF oracle's bound on logits (tests/model/test_hf_oracle.py); log_softmax adds a shared shift


def _prompt(vocab: int, n: int, seed: int = 3) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def engine():
    # 64-token chunks: a 300-token prompt takes five steps, each asking for its own positions
    eng = Engine("glm-5.3-tiny", device="cpu", kv_layout="fp32", num_pages=64, chunked_prefill_size=64,
                 max_num_batched_tokens=64)
    yield eng
    eng.close()


def _hf_logprobs(eng: Engine, prompt: list[int]) -> torch.Tensor:
    """HF transformers' log-softmax at every position of the prompt, in float32, on the engine's checkpoint."""
    with torch.no_grad():
        logits = hf_model(str(eng.core.runner.checkpoint))(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), -1)


def _check(entries: list, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for i in range(1, len(prompt)):
        e, row = entries[i], ref[i - 1]
        assert abs(e["logprob"] - float(row[prompt[i]])) < ATOL, i
        assert e["rank"] == int((row > row[prompt[i]] + ATOL).sum()) + 1 or abs(  # rank up to near ties
            float(row.sort(descending=True).values[e["rank"] - 1]) - e["logprob"]) < ATOL, i
        top = row.topk(k)
        assert len(e["top"]) == k
        for (tid, lp), v in zip(e["top"], top.values.tolist(), strict=True):
            assert abs(lp - v) < ATOL and abs(float(row[tid]) - lp) < ATOL, i


def test_prompt_logprobs_match_transformers_over_chunks_and_the_cache(engine):
    vocab = engine.core.runner.cfg.vocab_size
    prompt = _prompt(vocab, 300)
    ref = _hf_logprobs(engine, prompt)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    [first] = engine.generate([prompt], params)
    _check(first.prompt_logprobs, prompt, ref, 3)
    # the same prompt again: its 4 full pages' entries are cached (engine/prompt_entry_cache.py), so it takes them and
    # 3 pages of KV; the position before the 4th page's end and the partial page are computed again
    [again] = engine.generate([prompt], params)
    assert again.num_cached_tokens == 192
    assert again.prompt_logprobs[:256] == first.prompt_logprobs[:256]
    _check(again.prompt_logprobs, prompt, ref, 3)
    # fewer alternatives than cached are served cut; more are computed
    [fewer] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    assert fewer.num_cached_tokens == 192 and all(len(e["top"]) == 1 for e in fewer.prompt_logprobs[1:])
    [more] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=5))
    assert more.num_cached_tokens == 0
    _check(more.prompt_logprobs, prompt, ref, 5)
    # without prompt logprobs the cache serves it as before, and none are returned
    [plain] = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2))
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert plain.token_ids == first.token_ids


def test_prompt_logprobs_in_a_mixed_batch_with_n_samples(engine):
    vocab = engine.core.runner.cfg.vocab_size
    prompts = [_prompt(vocab, 70, seed=5), _prompt(vocab, 1, seed=6), _prompt(vocab, 130, seed=7)]
    outs = engine.generate(prompts, [SamplingParams(temperature=0.8, seed=1, n=2, max_tokens=3, prompt_logprobs=0),
                                     SamplingParams(max_tokens=3, prompt_logprobs=2),
                                     SamplingParams(max_tokens=3)])
    assert [len(o.prompt_logprobs or []) for o in outs] == [70, 1, 0]
    assert outs[1].prompt_logprobs == [None]  # a one-token prompt has nothing before its token
    assert all(e["top"] == [] for e in outs[0].prompt_logprobs[1:])
    alone = engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))[0]
    for a, b in zip(alone.prompt_logprobs[1:], outs[0].prompt_logprobs[1:], strict=True):
        assert abs(a["logprob"] - b["logprob"]) < 1e-4 and a["rank"] == b["rank"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path: piecewise graphs, bf16 compute, FP8 KV")
def test_prompt_logprobs_on_the_gpu_equal_the_samplers_logprobs_of_the_same_tokens():
    """On the GPU path (piecewise graphs over 128-token chunks) an entry is the sampler's logprob of the same token
    after the same prefix (forced by logit_bias; its KV from the prefix cache, which the first request filled).
    Not against HF: the random tiny model's bf16 + FP8 logits stray from float32's by whole nats."""
    from dsaserve.common.counters import COUNTERS

    eng = Engine("glm-5.3-tiny", device="cuda", num_pages=256, chunked_prefill_size=128, max_num_batched_tokens=256)
    try:
        prompt = _prompt(eng.core.runner.cfg.vocab_size, 300)
        before = COUNTERS.snapshot()
        [out] = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
        assert COUNTERS.diff(COUNTERS.snapshot(), before).get("piecewise_replays", 0) >= 3  # 128-token chunks
        assert len(out.prompt_logprobs) == 300 and out.prompt_logprobs[0] is None
        for p in (1, 100, 130, 299):  # the first chunk, inside the second, the third
            forced = eng.generate([prompt[:p]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=1,
                                                               logit_bias={prompt[p]: 100.0}))[0]
            assert forced.token_ids == [prompt[p]]
            e, lp = out.prompt_logprobs[p], forced.logprobs[0]
            assert abs(e["logprob"] - lp["logprob"]) < 0.05, p
            assert (e["rank"] == 1) == (lp["top"][0][0] == prompt[p]) or abs(lp["top"][0][1] - lp["logprob"]) < 0.05
    finally:
        eng.close()
