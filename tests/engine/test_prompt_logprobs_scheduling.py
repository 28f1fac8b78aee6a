"""Prompt logprobs through EngineCore on the fake runner (tests/engine/fake_runner.py; its KV read back through the
page table), with overlap scheduling, preemption, the prefix cache, n > 1 and aborts. The oracle is exact: the
entry of prompt position i is log_softmax(fake_logits(prompt[:i]))[prompt[i]]."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.request import EngineRequest
from tests.engine.fake_runner import FakeRunner, fake_logits, prompts


class PLRunner(FakeRunner):
    """FakeRunner plus prompt logprobs from the KV it reads back (as the model does from its hidden rows)."""

    last_prompt_logprobs = None

    def forward(self, batch):
        logits = super().forward(batch)
        self.last_prompt_logprobs = None
        if batch.prompt_rows is not None:
            chosen, rank, tv, ti = [], [], [], []
            for i, tgt in zip(batch.prompt_rows.tolist(), batch.prompt_targets.tolist(), strict=True):
                r, p = int(batch.req_index[i]), int(batch.positions[i])
                slots = batch.slots_of(r, p + 1)
                assert torch.equal(self.kv_pos[slots], torch.arange(p + 1)), "stale KV under a prompt row"
                lp = torch.log_softmax(fake_logits(self.kv_tok[slots].tolist(), self.cfg.vocab_size,
                                                   self.eos_every), -1)
                chosen.append(lp[tgt])
                rank.append(int((lp > lp[tgt]).sum()) + 1)
                v, ix = lp.topk(batch.prompt_k) if batch.prompt_k else (lp[:0], lp[:0].long())
                tv.append(v)
                ti.append(ix)
            self.last_prompt_logprobs = (torch.stack(chosen), torch.tensor(rank), torch.stack(tv), torch.stack(ti))
        return logits


def oracle(prompt: list[int]) -> list[float | None]:
    return [None] + [float(torch.log_softmax(fake_logits(prompt[:i]), -1)[prompt[i]]) for i in range(1, len(prompt))]


def make(overlap: bool, num_pages: int, **kw) -> EngineCore:
    return EngineCore(EngineArgs(disable_overlap_schedule=not overlap, **kw), runner=PLRunner(num_pages=num_pages))


def drive(core, max_steps=20_000, on_step=None):
    got: dict[tuple[str, int], list] = {}
    done: dict[tuple[str, int], str] = {}
    for step in range(max_steps):
        if on_step is not None:
            on_step(step, core)
        if not core.has_unfinished():
            return got, done
        for d in core.step():
            key = (d.request_id, d.index)
            if d.prompt_logprobs is not None:
                assert key not in got, f"{key}: prompt logprobs sent twice"
                got[key] = [None if e is None else e["logprob"] for e in d.prompt_logprobs]
            if d.finished:
                done[key] = d.finish_reason
    raise AssertionError("no end")


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_exact_under_preemption_cache_and_n(overlap):
    core = make(overlap, num_pages=12, max_num_batched_tokens=96, chunked_prefill_size=40, max_running_requests=6)
    base = prompts(1, 200, 200, seed=9)[0]
    ps = prompts(14, 2, 300, seed=4) + [base[:130] + p for p in prompts(4, 10, 120, seed=5)]
    want = {}
    for j, p in enumerate(ps):
        n = 1 + j % 3
        core.add_request(EngineRequest(f"r{j}", p, SamplingParams(temperature=0.7, seed=j, n=n, max_tokens=5,
                                                                  ignore_eos=True, prompt_logprobs=j % 4)))
        for i in range(n):
            want[(f"r{j}", i)] = oracle(p)
    got, done = drive(core)
    assert core.scheduler.counters["preemptions"] > 0
    for key, w in want.items():
        assert key in got, key
        assert len(got[key]) == len(w), key
        for a, b in zip(got[key], w, strict=True):
            assert (a is None and b is None) or abs(a - b) < 1e-5, key
    core.check_no_leak()


@pytest.mark.parametrize("overlap", [False, True])
def test_n_samples_compute_the_prompt_entries_once_even_without_free_rows(overlap):
    """n=3 with rows for only two samples when the prompt completes: the third sample joins the waiting queue
    as an ordinary request. 'n>1 samples share the entries' (computed once): it should not compute the prompt's
    entries again (nor lose the prefix cache for its whole prompt)."""
    core = make(overlap, num_pages=32, max_num_batched_tokens=64, chunked_prefill_size=64, max_running_requests=3)
    p = prompts(1, 200, 200, seed=11)[0]
    core.add_request(EngineRequest("busy", [40, 41], SamplingParams(max_tokens=50, ignore_eos=True)))  # holds a row
    core.step()
    core.add_request(EngineRequest("r", p, SamplingParams(temperature=0.7, seed=1, n=3, max_tokens=3,
                                                          ignore_eos=True, prompt_logprobs=1)))
    got, _ = drive(core)
    assert sorted(k for k in got if k[0] == "r") == [("r", 0), ("r", 1), ("r", 2)]
    assert all(len(v) == len(p) for k, v in got.items() if k[0] == "r")
    rows = sum(b.prompt_rows.numel() for b in core.runner.batches if b.prompt_rows is not None)
    assert rows == len(p) - 1, f"{rows} prompt rows computed for a {len(p)}-token prompt"


@pytest.mark.parametrize("overlap", [False, True])
def test_choices_sharing_a_context_take_its_entries_from_the_cache(overlap):
    """lm-eval's multiple choice: 4 requests of one 200-token context and different 20-token endings. The first
    scores the whole prompt; the others take the context's 3 full pages of entries (engine/prompt_entry_cache.py),
    2 pages of KV, and compute from position 128 on — every entry exact."""
    core = make(overlap, num_pages=64, max_num_batched_tokens=96, chunked_prefill_size=64, max_running_requests=8)
    ctx = prompts(1, 200, 200, seed=21)[0]
    ends = prompts(4, 20, 20, seed=22)
    want = {}
    for j, end in enumerate(ends):
        core.add_request(EngineRequest(f"c{j}", ctx + end, SamplingParams(temperature=0.0, max_tokens=1,
                                                                           prompt_logprobs=1)))
        want[(f"c{j}", 0)] = oracle(ctx + end)
        if j == 0:
            drive(core)  # the first choice finishes before the others arrive (lm-eval sends them one at a time)
            first_rows = sum(b.prompt_rows.numel() for b in core.runner.batches if b.prompt_rows is not None)
    got, _ = drive(core)
    rows = sum(b.prompt_rows.numel() for b in core.runner.batches if b.prompt_rows is not None)
    assert first_rows == 219 and rows - first_rows == 3 * (220 - 192)  # each later choice: positions 191..218
    assert core.scheduler.prompt_entries.hit_tokens == 3 * 192
    for key in [("c1", 0), ("c2", 0), ("c3", 0)]:
        assert len(got[key]) == 220
        assert all((a is None and b is None) or abs(a - b) < 1e-5 for a, b in zip(got[key], want[key], strict=True))
    core.check_no_leak()


def test_the_entry_cache_keeps_at_most_its_pairs_oldest_first():
    from dsaserve.engine.prompt_entry_cache import PromptEntryCache
    from dsaserve.engine.request import Req

    core = make(False, num_pages=64, max_num_batched_tokens=96)
    cache = PromptEntryCache(core.scheduler.cache, max_pairs=3 * 64 * 2)  # three pages at top-1

    def scored(seed: int, k: int) -> Req:
        p = prompts(1, 128, 128, seed=seed)[0]
        r = Req(f"s{seed}", 0, p, SamplingParams(prompt_logprobs=k), 0.0, seed, 1000, frozenset())
        r.prompt_logprobs = [None] + [{"logprob": -1.0, "rank": 1, "top": [[1, -1.0]] * k} for _ in p[1:]]
        return r

    a, b = scored(1, 1), scored(2, 1)
    cache.store(a)
    cache.store(b)  # 4 pages at top-1 > 3: a's first page goes
    assert cache.pairs == 3 * 128 and len(cache.pages) == 3 and a.page_hashes[0] not in cache.pages
    cache.store(scored(3, 2))  # two pages at top-2 (3 pairs an entry): only they fit
    assert cache.pairs == 2 * 64 * 3 and len(cache.pages) == 2
