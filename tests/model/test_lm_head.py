"""The lm_head's logits (model/layers/embedding.py): bf16 by default (handed to the sampler as they are), float32
from the same bf16 operands with DSASERVE_FP32_LM_HEAD=1 (the quality comparison `dsaserve eval --groups
fp32_head` makes on a GPU)."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common import envs
from dsaserve.model.layers import embedding
from dsaserve.model.layers.embedding import LMHead


def test_the_fp32_lm_head_keeps_what_bf16_logits_round_away(monkeypatch):
    torch.manual_seed(0)
    head = LMHead(512, 64)
    head.weight.data.normal_()
    h = torch.randn(5, 64, dtype=torch.bfloat16)
    exact = h.double() @ head.weight.double().t()
    default = head(h)
    with envs.override(DSASERVE_FP32_LM_HEAD="1"):
        fp32 = head(h)
    assert default.dtype == head.out_dtype() == torch.bfloat16 and fp32.dtype == torch.float32  # no float copy
    with envs.override(DSASERVE_FP32_LM_HEAD="1"):
        assert head.out_dtype() == torch.float32
    assert (fp32.double() - exact).abs().max() < 1e-4 < (default.double() - exact).abs().max()
    monkeypatch.setattr(embedding, "FLOAT_COPY", True)  # the copy the step made before
    copied = head(h)
    monkeypatch.setattr(embedding, "FLOAT_COPY", False)
    assert copied.dtype == torch.float32 and torch.equal(copied, default.float())
    head.finalize(torch.float32)  # a float32 model (the CPU reference): the switch changes nothing
    with envs.override(DSASERVE_FP32_LM_HEAD="1"):
        assert torch.equal(head(h.float()), h.float() @ head.weight.t())


def test_a_bf16_engine_samples_the_same_with_and_without_the_float_copy(monkeypatch):
    """End to end on the CPU in bf16: the engine's tokens and logprobs are the same whether the lm_head hands the
    sampler its bf16 logits or their float32 copy (the step before 2026-12-05), greedy, seeded, penalised, n = 2."""
    from dsaserve import Engine, SamplingParams

    prompts = [[5, 6, 7, 8] * 5, [11, 12, 13] * 7, [40, 41] * 9]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2),
              SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, presence_penalty=0.5, logit_bias={9: 2.0}, max_tokens=8,
                             ignore_eos=True)]
    outs = []
    for copy in (False, True):
        monkeypatch.setattr(embedding, "FLOAT_COPY", copy)
        eng = Engine("glm-5.3-tiny", device="cpu", dtype="bfloat16", num_pages=32)
        assert eng.core.runner.model.logits_dtype() == (torch.float32 if copy else torch.bfloat16)
        outs.append([(c.token_ids, c.logprobs) for o in eng.generate(prompts, params) for c in o.outputs])
    assert outs[0] == outs[1]
    assert len({tuple(t) for t, _ in outs[0]}) > 1


def test_logits_into_a_given_buffer_are_the_returned_logits(monkeypatch):
    """`out` (the CUDA graphs' one logits buffer): written in the GEMM's dtype, the same numbers as without it, and
    returned as the buffer itself — by the GEMM where nothing follows it, by a copy after the float32 paths."""
    torch.manual_seed(0)
    head = LMHead(512, 64)
    head.weight.data.normal_()
    h = torch.randn(5, 64, dtype=torch.bfloat16)
    for fp32, copy in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(embedding, "FLOAT_COPY", copy)
        with envs.override(DSASERVE_FP32_LM_HEAD="1" if fp32 else "0"):
            ref = head(h)
            buf = torch.full((8, 512), float("nan"), dtype=head.out_dtype())
            got = head(h, out=buf[:5])
        assert got.data_ptr() == buf.data_ptr() and torch.equal(got, ref), (fp32, copy)
        assert buf[5:].isnan().all()
    monkeypatch.setattr(embedding, "FLOAT_COPY", False)
    with pytest.raises(ValueError, match="logits buffer is torch.float32"):  # a buffer of another dtype: refused
        head(h, out=torch.empty(5, 512))
