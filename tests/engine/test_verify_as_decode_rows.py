"""A verify step as decode rows (`forward_batch.as_decode_rows`, what the decode CUDA graphs replay under
speculative decoding): the same logits, hidden rows and KV as the step with a request's tokens in one row, on the
CPU's reference path; and a drafting engine whose every verify runs so answers plain decoding's tokens."""

from __future__ import annotations

import torch

from dsaserve import Engine, SamplingParams
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import as_decode_rows, contiguous_batch

PROMPTS = [[5, 6, 7, 8, 9] * 14, [11, 12, 13] * 5, list(range(40, 66))]  # the first past one 64-token page


def _step(runner: ModelRunner, batch):
    """(logits, hidden, the KV pool after) of one forward from the pool as it is now (restored after)."""
    saved = runner.kv_pool.kv_buffer.clone(), runner.kv_pool.index_buffer.clone()
    logits, hidden = runner.model(batch, runner.kv_pool)
    after = runner.kv_pool.kv_buffer.clone(), runner.kv_pool.index_buffer.clone()
    runner.kv_pool.kv_buffer.copy_(saved[0])
    runner.kv_pool.index_buffer.copy_(saved[1])
    return logits, hidden, after


def test_decode_rows_compute_the_verify_step_exactly():
    runner = ModelRunner.from_kwargs("glm-5.3-tiny", kv_layout="fp32", dtype="float32", num_pages=16)
    bases = [0, 4 * 64, 8 * 64]
    runner.model(contiguous_batch(PROMPTS, [0, 0, 0], bases), runner.kv_pool)  # the prompts' KV
    # request 0 verifies its token and 3 drafts, request 1 decodes one token, request 2 verifies 1 draft
    new = [[3, 14, 15, 92], [6], [53, 58]]
    batch = contiguous_batch(new, [len(p) for p in PROMPTS], bases)
    batch.logits_indices = torch.arange(batch.num_tokens)
    rows = as_decode_rows(batch)
    assert rows is not None and rows.batch_size == rows.num_tokens == 7 and rows.extend_lens_cpu == [1] * 7
    assert rows.seq_lens_cpu == [len(PROMPTS[r]) + j + 1 for r, n in enumerate(new) for j in range(len(n))]
    ref, got = _step(runner, batch), _step(runner, rows)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    for a, b in zip(got[2], ref[2], strict=True):  # every token's KV at its slot, as the request's row writes it
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_only_steps_whose_every_token_samples_become_decode_rows():
    batch = contiguous_batch([[1, 2, 3], [4]], [0, 9], [0, 64])
    assert as_decode_rows(batch) is None  # a prompt chunk samples its last token only
    decode = contiguous_batch([[1], [4]], [5, 9], [0, 64])
    assert as_decode_rows(decode) is None  # already one token a row
    batch.logits_indices = torch.arange(4)
    batch.prompt_rows = torch.tensor([0])
    assert as_decode_rows(batch) is None  # prompt logprobs read the step's own rows


def test_a_drafting_engine_verifying_as_decode_rows_answers_plain_decoding():
    """Every verify step through `as_decode_rows`, eagerly (the CPU has no graphs to replay them): greedy tokens and
    logprobs of plain decoding, the drafts kept as the request-row step keeps them."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    texts = ["The quick brown fox", "def fibonacci(n):"]
    plain = Engine("glm-5.3-mini", device="cpu", kv_layout="fp32").generate(texts, params)
    eng = Engine("glm-5.3-mini", device="cpu", kv_layout="fp32", speculative_algorithm="mtp",
                 speculative_num_steps=3)
    runner, used = eng.core.runner, []

    def as_rows(batch):
        rows = as_decode_rows(batch)
        used.append(rows is not None)
        return runner._run(rows or batch, False)

    runner.forward_with_hidden = as_rows
    spec = eng.generate(texts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    for p, s in zip(plain, spec, strict=True):
        torch.testing.assert_close([lp["logprob"] for lp in s.logprobs], [lp["logprob"] for lp in p.logprobs],
                                   rtol=1e-4, atol=1e-4)
    assert sum(used) > 5 and eng.core.stats()["spec_accepted_tokens"] > 0
    eng.core.check_no_leak()
