"""One `dsaserve eval` setting (dsaserve/quality/runs.py) on the tiny checkpoint: the FP8-activation switch
holds for the run and the process environment is the same afterwards; the HF-oracle setting runs through the
same entry point and, with the exact fp32 KV, is the engine's model."""

from __future__ import annotations

import os

import pytest

from dsaserve.common import envs
from dsaserve.quality import runs
from dsaserve.quality.runs import Setting, run_setting

MODEL = "glm-5.3-tiny"
WINS = [[(5 * i + j) % 500 + 2 for i in range(48)] for j in range(2)]
PROMPTS = [[(3 * i + j) % 500 + 2 for i in range(40)] for j in range(2)]


def test_a_run_holds_its_fp8_switch_and_leaves_the_environment_as_it_was(tiny_checkpoint, monkeypatch):
    ckpt, environ, seen = str(tiny_checkpoint(MODEL)), dict(os.environ), []
    before = envs.DSASERVE_FP8_ACTIVATIONS
    perplexity = runs.perplexity

    def spy(runner, wins, batch):
        seen.append((envs.DSASERVE_FP8_ACTIVATIONS, dict(os.environ)))
        if len(seen) == 2:
            raise RuntimeError("a setting failed mid-run")
        return perplexity(runner, wins, batch)

    monkeypatch.setattr(runs, "perplexity", spy)
    out = run_setting(ckpt, Setting("off", "cpu", "bf16", fp8_act=False), WINS, PROMPTS, 2, 2)
    assert len(out["greedy"]) == 2 and all(len(g) == 2 for g in out["greedy"])
    with pytest.raises(RuntimeError):
        run_setting(ckpt, Setting("on", "cpu", "bf16", fp8_act=True), WINS, PROMPTS, 2, 2)
    assert [s[0] for s in seen] == ["0", "1"]
    assert all(s[1] == environ for s in seen)  # never written, not even during the run
    assert dict(os.environ) == environ and before == envs.DSASERVE_FP8_ACTIVATIONS


def test_the_hf_setting_with_fp32_kv_is_the_engine(tiny_checkpoint):
    ckpt = str(tiny_checkpoint(MODEL))
    ours = run_setting(ckpt, Setting("cpu:fp32", "cpu", "fp32"), WINS, PROMPTS, 4, 2)
    hf = run_setting(ckpt, Setting("hf:fp32", "cpu", "fp32", hf=True), WINS, PROMPTS, 4, 2)
    assert hf["describe"].startswith("HF transformers") and hf["tokens"] == ours["tokens"] == 2 * 47
    assert abs(hf["loss"] - ours["loss"]) < 1e-4
    for a, b, margins in zip(ours["greedy"], hf["greedy"], hf["margins"], strict=True):
        k = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        assert k == len(a) or margins[k] < 1e-2, (a, b, margins)  # a parting only at a near-tie


def test_a_setting_computes_in_its_dtype(tiny_checkpoint):
    import torch

    s = Setting("cpu:bf16:bfloat16", "cpu", "bf16", dtype="bfloat16")
    runner = runs.open_runner(str(tiny_checkpoint(MODEL)), s, 128)
    assert runner.dtype == torch.bfloat16 and s.describe().startswith("cpu bfloat16, kv bf16")
    assert runs.open_runner(str(tiny_checkpoint(MODEL)), Setting("cpu:bf16", "cpu", "bf16"), 128).dtype == torch.float32


def test_a_graphs_setting_decodes_batch_prompts_a_step_through_forward_and_says_what_ran_there(
        tiny_checkpoint, monkeypatch):
    """On the CPU `forward` runs eagerly: the setting's tokens are the eager ones, its steps `--batch` rows, the
    cuBLASLt flag off for a torch_gemm setting's run only, and a warning names the decode steps no graph replayed."""
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.kernels import cublaslt_tuning

    ckpt, rows, flags = str(tiny_checkpoint(MODEL)), [], []
    forward = ModelRunner.forward

    def spy(self, batch):
        rows.append(len(batch.logits_indices))
        flags.append(cublaslt_tuning.TUNED)
        return forward(self, batch)

    monkeypatch.setattr(ModelRunner, "forward", spy)
    monkeypatch.setattr(cublaslt_tuning, "TUNED", True)
    chunked = run_setting(ckpt, Setting("c", "cpu", "fp32", chunked=True), WINS, PROMPTS, 3, 1)
    assert rows == [] and "graphs" not in chunked  # the eager settings never call forward
    out = run_setting(ckpt, Setting("g", "cpu", "fp32", graphs=True, gemm_tuning=False), WINS, PROMPTS, 3, 1)
    assert rows == [1] * 6 and flags == [False] * 6 and cublaslt_tuning.TUNED is True
    assert out["greedy"] == chunked["greedy"] and out["loss"] == chunked["loss"]
    assert out["graphs"]["routes"] == {"eager": 6} and out["warning"].startswith("4 of 4 decode steps did not replay")
