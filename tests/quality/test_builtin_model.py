"""The trained built-in model (dsaserve/builtin/glm-5.3-mini, from bench/train_builtin.py) as the yardstick of
numerics: skipped until the package ships it. What issue 18 asks of it:
  - engine greedy = HF greedy with the fp8_ds_mla KV layout too (not only the exact fp32 one), HF's KV going
    through the same FP8 codec (HF has no FP8 KV cache);
  - held-out perplexity far below the unigram baseline; fp8_ds_mla KV within 1 % of the bf16 KV's;
  - the MTP layer drafts real text: acceptance well above chance;
  - on a GPU: greedy equal to the CPU reference on >= 9 of 10 held-out prompts x 32 tokens (test_gpu_vs_cpu.py).
Prompts and windows come from the held-out split (rebuilt from the model's corpus_recipe.json).
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.quality.report import EvalArgs, heldout_data
from dsaserve.quality.runs import Setting, run_setting
from dsaserve.weights.checkpoint_cache import packaged_checkpoint

CKPT = packaged_checkpoint("glm-5.3-mini")
pytestmark = pytest.mark.skipif(CKPT is None, reason="dsaserve/builtin/glm-5.3-mini is not in this checkout")
NEAR_TIE = 0.1  # nats: a parting at a smaller top-1 margin is rounding, not a wrong KV read


@pytest.fixture(scope="module")
def data():
    wins, prompts, _ = heldout_data(EvalArgs(model=str(CKPT), windows=4, window_len=512, prompts=10, prompt_len=128))
    return wins, prompts


@pytest.fixture(scope="module")
def cpu_runs(data):
    wins, prompts = data
    return {layout: run_setting(str(CKPT), Setting(layout, "cpu", layout), wins, prompts, 16, 2)
            for layout in ("fp32", "bf16", "fp8_ds_mla")}


def greedy_against_hf(prompts: list[list[int]], got: list[list[int]], kv_layout: str | None) -> int:
    """How many of the engine's continuations equal HF's (HF's KV through `kv_layout`'s codec; None: HF's own
    float32 cache); fails if one parts from HF other than at a near-tie of HF's logits."""
    from dsaserve.quality.hf_oracle import hf_greedy_batch

    refs, logits = hf_greedy_batch(CKPT, prompts, len(got[0]), kv_layout)
    identical = 0
    for ours, ref, rows in zip(got, refs, logits, strict=True):
        if ours == ref:
            identical += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(ours, ref, strict=True)) if a != b)
        top = torch.log_softmax(rows[i], -1).topk(2).values
        assert float(top[0] - top[1]) < NEAR_TIE, f"parted at token {i} with margin {float(top[0] - top[1]):.3f}"
    return identical


def test_engine_greedy_equals_hf_with_the_exact_kv_layout(data, cpu_runs):
    """fp32 KV: the engine is HF's model, token for token (a parting only at a near-tie). Plain HF is no
    yardstick for a quantised layout: against it fp8_ds_mla KV keeps 7/10 continuations of 16 tokens (a parting
    at token 10 with a 0.36-nat margin) while its perplexity stays within 0.1 % - see the next test."""
    _, prompts = data
    assert greedy_against_hf(prompts, cpu_runs["fp32"]["greedy"], None) >= len(prompts) - 1


def test_engine_greedy_equals_hf_with_the_fp8_kv_codec(data, cpu_runs):
    """fp8_ds_mla KV: the engine equals HF whose cached latent and indexer keys go through the same codec
    (`kv_codec`). Measured 2026-12-01: 10/10 held-out continuations identical at 16 and at 32 tokens (plain HF:
    7/10 and 6/10). Why the logits are still not HF's to 1e-4 as with fp32 KV, and why that is not the engine:
    - layer 0, where both read the same input: the stored FP8 codes and BF16 rope are bit-identical and the FP32
      scales differ by <= 1e-5 relative (the amax of a latent another GEMM order computed): the codec runs at
      the same point (after the RMSNorm and the RoPE), with the same scale and rounding;
    - deeper layers inherit float32 differences (absorbed vs expanded MLA, GEMM orders), and a value within an
      ulp of an FP8 rounding boundary goes the other way, one FP8 step: 0.02 % of the codes in layer 1, 1.8 % in
      layer 6 of 7. Teacher-forced logits agree to ~0.01 (median per-position max |diff|; fp32 KV: 1e-4);
    - on top of that, discrete jumps where a selection has a near-tie: an indexer top-k boundary swap (<= 0.13
      logit) or an MoE router flip (~1 logit). The same happens with bf16 KV (layer 6's router on prompt 5:
      expert scores 0.474955 vs 0.474943), which parted one continuation at 32 tokens from HF run one prompt
      at a time (not from HF batched, as here)."""
    _, prompts = data
    assert greedy_against_hf(prompts, cpu_runs["fp8_ds_mla"]["greedy"], "fp8_ds_mla") >= len(prompts) - 1


def test_perplexity_and_kv_layouts(cpu_runs):
    import json

    baselines = json.loads((CKPT / "train_report.json").read_text())["baselines"]
    fp32, bf16, fp8 = (cpu_runs[k]["loss"] for k in ("fp32", "bf16", "fp8_ds_mla"))
    assert fp32 < baselines["unigram"] - 1.0  # nats/token: far below the unigram model
    assert abs(cpu_runs["fp8_ds_mla"]["ppl"] / cpu_runs["bf16"]["ppl"] - 1) < 0.01, (fp8, bf16)


def test_mtp_acceptance_on_real_text(cpu_runs):
    r = cpu_runs["fp32"]
    assert r["mtp_accept"] > 0.2 and r["mtp_acc"] > 0.1, r
