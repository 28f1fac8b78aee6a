"""The lm_head's logits (model/layers/embedding.py): bf16 by default, float32 from the same bf16 operands with
DSASERVE_FP32_LM_HEAD=1 (the quality comparison `dsaserve eval --groups fp32_head` makes on a GPU)."""

from __future__ import annotations

import torch

from dsaserve.common import envs
from dsaserve.model.layers.embedding import LMHead


def test_the_fp32_lm_head_keeps_what_bf16_logits_round_away():
    torch.manual_seed(0)
    head = LMHead(512, 64)
    head.weight.data.normal_()
    h = torch.randn(5, 64, dtype=torch.bfloat16)
    exact = h.double() @ head.weight.double().t()
    default = head(h)
    with envs.override(DSASERVE_FP32_LM_HEAD="1"):
        fp32 = head(h)
    assert default.dtype == fp32.dtype == torch.float32
    assert torch.equal(default, default.bfloat16().float())  # bf16 values: ties between close tokens
    assert (fp32.double() - exact).abs().max() < 1e-4 < (default.double() - exact).abs().max()
    head.finalize(torch.float32)  # a float32 model (the CPU reference): the switch changes nothing
    with envs.override(DSASERVE_FP32_LM_HEAD="1"):
        assert torch.equal(head(h.float()), h.float() @ head.weight.t())
