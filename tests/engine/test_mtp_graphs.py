"""The MTP layer's forwards as one token a row (engine/mtp_graphs.py; what its CUDA graphs replay), on the CPU:
an extend over a request's positions computes the same logits, output rows and KV as one token a row; and a
drafting engine whose every MTP forward goes through `MTPGraphRunner.replay_mtp` — its static inputs, the hidden
rows and chained drafts copied in, the drafts' rows picked after — with each "graph" run eagerly over the static
buffers (the CPU has no CUDA graphs), answers plain decoding with the same drafts kept."""

from __future__ import annotations

import torch

from dsaserve import Engine, SamplingParams
from dsaserve.common.counters import COUNTERS
from dsaserve.engine.cuda_graph_runner import _Graph
from dsaserve.engine.decode_graphs import DecodeGraphs
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.engine.mtp_graphs import MTPGraphRunner
from dsaserve.model.forward_batch import contiguous_batch, one_token_rows
from tests.engine.test_verify_as_decode_rows import PROMPTS


def _mtp_step(runner: ModelRunner, batch, prev_hidden: torch.Tensor):
    """(logits, output rows, the KV pool after) of one MTP forward from the pool as it is now (restored after)."""
    saved = runner.kv_pool.kv_buffer.clone(), runner.kv_pool.index_buffer.clone()
    logits, rows = runner.model.forward_mtp(batch, runner.kv_pool, prev_hidden, with_hidden=True)
    after = runner.kv_pool.kv_buffer.clone(), runner.kv_pool.index_buffer.clone()
    runner.kv_pool.kv_buffer.copy_(saved[0])
    runner.kv_pool.index_buffer.copy_(saved[1])
    return logits, rows, after


def test_an_mtp_extend_as_one_token_rows_computes_the_same_step():
    runner = ModelRunner.from_kwargs("glm-5.3-tiny", kv_layout="fp32", dtype="float32", num_pages=16,
                                     speculative_algorithm="mtp")
    bases = [0, 4 * 64, 8 * 64]
    prompt = contiguous_batch(PROMPTS, [0, 0, 0], bases)
    _, hidden = runner.model(prompt, runner.kv_pool)
    runner.model.forward_mtp(prompt, runner.kv_pool, hidden)  # the MTP layer's KV of the prompts
    # request 0 extends over 3 kept positions, request 1 over 1, request 2 over 2 and gives no draft
    new = [[3, 14, 15], [6], [53, 58]]
    batch = contiguous_batch(new, [len(p) for p in PROMPTS], bases)
    batch.logits_indices = torch.tensor([2, 3])
    prev = torch.randn(batch.num_tokens, runner.cfg.hidden_size)
    rows = one_token_rows(batch)
    assert rows.batch_size == rows.num_tokens == 6 and rows.extend_lens_cpu == [1] * 6
    assert torch.equal(rows.logits_indices, batch.logits_indices) and not rows.samples_every_token
    ref, got = _mtp_step(runner, batch, prev), _mtp_step(runner, rows, prev)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[2], ref[2], strict=True):  # the MTP layer's KV at every position, as the extend writes it
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class _EagerGraph:
    """A captured graph's stand-in: a replay runs the runner's graph body over its static buffers eagerly and
    writes the graph's output buffers, as a CUDA graph replay writes them (read after, valid until the next); and,
    as a replay may reuse its pool's memory, poisons every other bucket's hidden output (a read of one after
    another graph ran gives NaNs)."""

    def __init__(self, runner: MTPGraphRunner, bs: int, hidden: torch.Tensor):
        self.runner, self.bs, self.hidden = runner, bs, hidden

    def replay(self) -> None:
        enabled, COUNTERS.enabled = COUNTERS.enabled, False  # the replay's counts are `_count`'s, as on a GPU
        try:
            _, hidden = self.runner._forward(self.bs)  # the logits land in the runner's one buffer
        finally:
            COUNTERS.enabled = enabled
        for bs, g in self.runner.graphs.items():
            if bs != self.bs:
                g.hidden.fill_(float("nan"))
        self.hidden.copy_(hidden)


class _HostLensRunner(MTPGraphRunner):
    """The static batch with the host lengths of what was staged: the CPU's reference kernels read a batch's
    lengths on the host, where a captured GPU kernel reads the static device buffer."""

    def _static_batch(self, bs: int):
        batch = super()._static_batch(bs)
        batch.seq_lens_cpu = self.seq_lens[:bs].tolist()
        return batch


def _eager_mtp_graphs(runner: ModelRunner, max_bs: int) -> DecodeGraphs:
    """MTP "graphs" of every bucket size up to max_bs (no padding rows: the CPU pool has no sink page)."""
    pages = runner.kv_pool.num_pages

    def make(width: int) -> MTPGraphRunner:
        r = _HostLensRunner(runner.model, runner.kv_pool, max_bs, width, 0,
                            torch.empty(max_bs, runner.cfg.vocab_size, dtype=runner.model.logits_dtype()))
        r.buckets = list(range(1, max_bs + 1))
        for bs in r.buckets:
            hidden = torch.zeros(bs, runner.cfg.hidden_size)
            r.graphs[bs] = _Graph(_EagerGraph(r, bs, hidden), r.logits_out[:bs], hidden, {})
        return r

    return DecodeGraphs(make, [pages])


def _drafting(max_bs: int | None, texts: list[str], params: SamplingParams):
    """(outputs, stats, counters, forward_mtp calls) of a drafting engine (3 drafts), its MTP forwards through
    graphs of up to max_bs rows (None: eager)."""
    eng = Engine("glm-5.3-mini", device="cpu", kv_layout="fp32", speculative_algorithm="mtp",
                 speculative_num_steps=3)
    runner, calls = eng.core.runner, []
    if max_bs is not None:
        runner.mtp_graphs = _eager_mtp_graphs(runner, max_bs)
    forward_mtp = runner.forward_mtp
    runner.forward_mtp = lambda *a: calls.append(1) or forward_mtp(*a)
    before = COUNTERS.snapshot()
    out = eng.generate(texts, params)
    eng.core.check_no_leak()
    return out, eng.core.stats(), COUNTERS.diff(COUNTERS.snapshot(), before), len(calls)


def test_a_drafting_engine_whose_mtp_forwards_replay_graphs_answers_plain_decoding():
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    texts = ["The quick brown fox", "def fibonacci(n):", "Sparse attention selects"]
    plain = Engine("glm-5.3-mini", device="cpu", kv_layout="fp32").generate(texts, params)
    _, eager, _, _ = _drafting(None, texts, params)
    # 16 rows: every forward but the prompts' extend replays; 2 rows: the 3 requests' forwards run eagerly until
    # requests stop chaining near their end (a graph then takes the picked rows of an eager forward's drafts)
    for max_bs in (16, 2):
        spec, stats, diff, calls = _drafting(max_bs, texts, params)
        assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
        for p, s in zip(plain, spec, strict=True):
            torch.testing.assert_close([lp["logprob"] for lp in s.logprobs], [lp["logprob"] for lp in p.logprobs],
                                       rtol=1e-4, atol=1e-4)
        # the drafts are the eager MTP forwards' (the same numbers up to float32 summation order)
        assert stats["spec_accepted_tokens"] == eager["spec_accepted_tokens"] > 0
        assert stats["spec_draft_tokens"] == eager["spec_draft_tokens"]
        eager_runs = sum(v for k, v in diff.items() if k.startswith("mtp_eager."))
        assert diff.get("mtp_graph_replays", 0) + eager_runs == calls
        if max_bs == 16:  # the prompts' extend: 26 tokens, over the largest bucket
            assert diff.get("mtp_eager.batch_over_max_bs") == 1 and calls - 1 >= 2 * stats["steps"]
        else:
            assert diff.get("mtp_graph_replays", 0) > 0 and eager_runs > 0
