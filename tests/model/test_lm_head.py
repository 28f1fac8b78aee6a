"""The lm_head's logits (model/layers/embedding.py): bf16 by default (handed to the sampler as they are), float32
from the same bf16 operands with DSASERVE_FP32_LM_HEAD=1 (the quality comparison `dsaserve eval --groups
fp32_head` makes on a GPU)."""

from __future__ import annotations

import torch

from dsaserve.common import envs
from dsaserve.model.layers import embedding
from dsaserve.model.layers.embedding import LMHead


def _with_float_copy(head: LMHead, h: torch.Tensor) -> torch.Tensor:
    embedding.FLOAT_COPY = True
    try:
        return head(h)
    finally:
        embedding.FLOAT_COPY = False


def test_the_fp32_lm_head_keeps_what_bf16_logits_round_away():
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
    copied = _with_float_copy(head, h)
    assert copied.dtype == torch.float32 and torch.equal(copied, default.float())  # the copy the step made before
    head.finalize(torch.float32)  # a float32 model (the CPU reference): the switch changes nothing
    with envs.override(DSASERVE_FP32_LM_HEAD="1"):
        assert torch.equal(head(h.float()), h.float() @ head.weight.t())
