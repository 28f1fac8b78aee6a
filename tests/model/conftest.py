"""Shared fixtures of the model tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cpu_model(tiny_checkpoint):
    """name -> the built-in tiny config's model on the CPU reference kernels (float32, FP8 weights kept), no MTP."""
    from dsaserve.config import load_config
    from dsaserve.model.glm_moe_dsa import DsaForCausalLM
    from dsaserve.weights.loader import load_checkpoint

    def make(name: str) -> DsaForCausalLM:
        ckpt = tiny_checkpoint(name)
        model = DsaForCausalLM(load_config(ckpt), with_mtp=False)
        load_checkpoint(model, ckpt, progress=False)
        model.finalize(torch.float32, torch.device("cpu"), keep_fp8=True)
        return model

    return make
