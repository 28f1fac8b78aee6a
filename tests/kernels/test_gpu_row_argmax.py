"""The greedy sampler's split-row argmax (`kernels/triton_argmax.py`) against torch's argmax: every row's first
maximum, bit for bit, with ties inside a block, across blocks and across a row's programs, -inf rows, NaN, -0 and
+0, at the batch sizes and vocabularies the engine runs (the interpreter: smaller vocabularies, a few programs a row),
and its counters left at zero for the next launch. Set-up: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import BIG, DEVICE, requires_gpu_kernels

pytestmark = requires_gpu_kernels

VOCABS = [154_880, 129_280, 1_000] if BIG else [20_001, 8_192, 1_000]  # GLM-5.3's, DeepSeek-V3.2's, small


def _check(x: torch.Tensor) -> torch.Tensor:
    from dsaserve.kernels import triton_argmax as A

    got = A.row_argmax(x)
    want = R.row_argmax(x)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    assert not A.workspace(x.device)[0].any(), "the counters must be zero after a launch"
    return got


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 64, 130])
def test_row_argmax_equals_torch(gen, rows, dtype):
    """Random logits, then the same with each row's maximum repeated at a later column in another program's chunk
    and in the same block (the first one must win)."""
    from dsaserve.kernels import triton_argmax as A

    for vocab in VOCABS if rows <= 3 else VOCABS[-1:]:
        x = torch.randn(rows, vocab, generator=gen, device=DEVICE).to(dtype)
        first = _check(x)
        top = x.max(dim=-1).values
        later = torch.randint(0, vocab, (rows,), generator=gen, device=DEVICE)
        x[torch.arange(rows, device=DEVICE), later] = top  # a tie, before or after the first maximum
        _check(x)
        x[torch.arange(rows, device=DEVICE), (first + 1).clamp(max=vocab - 1)] = top
        _check(x)
        assert A.split_plan(rows, vocab, 4)[0] >= 1


def test_row_argmax_special_values(gen):
    """A row of -inf (token 0), a NaN (above every number, torch's order), +inf, -0 before +0 (equal: the first),
    every value equal, the maximum in the last column, a row whose only finite value is in its last program."""
    n = 3 * 8192 + 5
    x = torch.randn(8, n, generator=gen, device=DEVICE)
    x[0] = float("-inf")
    x[1, 700] = float("nan")
    x[1, 9000] = float("inf")
    x[2] = -1.0
    x[2, 20_000] = -0.0
    x[2, 20_001] = 0.0
    x[3] = 0.5
    x[4, -1] = 100.0
    x[5] = float("-inf")
    x[5, n - 2] = -3.0
    x[6, 17_000:17_004] = float("inf")
    x[7, 3] = float("nan")
    x[7, 9] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        got = _check(x.to(dtype))
        assert got[0] == 0 and got[2] == 20_000 and got[3] == 0 and got[4] == n - 1 and got[5] == n - 2


def test_row_argmax_strided_rows(gen):
    """Rows of a wider buffer (the sampler's logits[:1], a view with the vocabulary's stride) and a column slice."""
    base = torch.randn(4, 12_000, generator=gen, device=DEVICE, dtype=torch.bfloat16)
    _check(base[:1])
    _check(base[1:3, :9_000])


def test_the_sampler_draws_the_same_with_the_kernel(gen, set_switch):
    """The sampler with the GPU ops (the interpreter's on the CPU) against the reference ops on the same logits:
    a plain greedy bf16 batch, a greedy batch with a penalty (float32), and a mixed batch of greedy and seeded
    temperature / top-p rows (both of `_random`'s argmaxes): the same tokens and logprobs."""
    import contextlib

    from dsaserve.common.sampling_params import SamplingParams
    from dsaserve.kernels import registry
    from dsaserve.model.sampler import Sampler
    from tests.engine.test_sampler import Row

    batches = [[SamplingParams(temperature=0.0)] * 3,
               [SamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=2)] * 2,
               [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=5, top_p=0.9, logprobs=1),
                SamplingParams(temperature=1.2, seed=11)]]
    for params in batches:
        logits = torch.randn(len(params), 20_001, generator=gen, device=DEVICE).to(torch.bfloat16)
        outs = []
        for gpu in (False, True):
            set_switch("DSASERVE_ROW_ARGMAX", "triton")  # the kernel is opt-in (envs.py says why)
            set_switch(registry.ENV_VAR, "auto" if gpu else "reference")  # envs reads its switches again
            interp = registry.interpreted_gpu_ops() if gpu and DEVICE == "cpu" else contextlib.nullcontext()
            with interp:
                assert registry.get_ops(DEVICE).impls["row_argmax"].startswith("triton") == gpu
                outs.append(Sampler(seed=3).sample(logits, [Row(p, prompt_token_ids=[1, 7, 9]) for p in params]))
        assert outs[0].token_ids == outs[1].token_ids and outs[0].logprobs == outs[1].logprobs
