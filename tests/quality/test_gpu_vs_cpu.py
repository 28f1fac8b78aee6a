"""The GPU path against the CPU reference on the trained built-in model (issue 18), as `dsaserve eval` asks it.

glm-5.3-mini, 10 held-out prompts x 32 greedy tokens, both with the engine's default fp8_ds_mla KV layout: the
GPU path (bf16, the Triton kernels, FP8 activations on) against the CPU reference (fp32 on dequantised
weights): identical, or parted only at a near-tie, on >= 9 of 10 prompts (the test's docstring says why not
"identical"). Printed beside it, each with every parting's step and both runs' top-1
margins there (nats; a parting at a near-tie is rounding, one at a wide margin an error or a flipped discrete
choice, an indexer top-k or MoE router tie): FP8 activations off; the GPU against the CPU path computing in
bfloat16 (same dtype, so what is left is kernel order and FP8 activations); the CPU in bfloat16 against float32
(what bf16 rounding alone does); and all of these again with the bf16 KV layout. The settings, prompts and
agreement metric are eval's own (`quality/report.py`: make_plan's "fp8_act" and "cpu_ref" groups,
heldout_data, compare). Needs a GPU: `pytest -s tests/quality/test_gpu_vs_cpu.py` on the H200.
"""

from __future__ import annotations

import pytest
import torch

from dsaserve.quality.report import EvalArgs, compare, heldout_data, make_plan
from dsaserve.quality.runs import run_setting
from dsaserve.weights.checkpoint_cache import packaged_checkpoint

CKPT = packaged_checkpoint("glm-5.3-mini")
pytestmark = [pytest.mark.skipif(CKPT is None, reason="dsaserve/builtin/glm-5.3-mini is not in this checkout"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU path needs CUDA")]
TOKENS = 32


def _rows(kv_layout: str, groups: tuple[str, ...], wins: list[list[int]], prompts: list[list[int]]) -> list[dict]:
    """eval's comparisons of `groups` with the base on `kv_layout`, on these prompts (one perplexity window)."""
    plan = make_plan(EvalArgs(model=str(CKPT), device="cuda", kv_layout=kv_layout, groups=groups, windows=1,
                              prompts=len(prompts), max_tokens=TOKENS))
    results = {s.name: run_setting(str(CKPT), s, wins[:1], prompts, TOKENS, 1) for s in plan.settings}
    return compare(results, plan.pairs)


def _show(r: dict) -> str:
    parts = ", ".join(f"#{p['prompt']}@{p['step']} {p['margin']:.3f}/{p['ref_margin']:.3f}" for p in r["partings"])
    return (f"{r['question']:34} {r['setting']:>22} vs {r['reference']:24} {r['identical']}/{r['of']} identical, "
            f"prefix {r['mean_prefix']:5.1f}, max parting margin {r['max_parting_margin']}; partings: {parts or '-'}")


NEAR_TIE = 1.0  # nats: the two runs' top-1 margins at a parting, summed; a wrong kernel parts at several


def _agreeing(r: dict) -> int:
    """Prompts identical, or parted only at a near-tie."""
    return r["identical"] + sum(p["margin"] + p["ref_margin"] <= NEAR_TIE for p in r["partings"])


def test_gpu_greedy_agrees_with_the_cpu_reference_up_to_near_ties(set_switch):
    """The issue's criterion, identical greedy tokens on >= 9 of 10 prompts, is printed, not asserted: on the H200
    (2026-11-30) the GPU path gave 6/10 against the CPU reference, and so did the CPU's own bf16 path against its
    fp32 (6-8/10); every GPU parting against the bf16 CPU reference came at a near-tie (the two margins summing to
    <= 0.56 nats; bf16 logits are quantised to ~0.06 nats here), bench/RESULTS.md "Seventh session". Asserted:
    on >= 9 of 10 prompts every GPU-vs-CPU pair is identical or parts at a near-tie, and each perplexity is
    within 1 % of its CPU reference's."""
    set_switch("DSASERVE_KERNELS", None)  # the default kernels, whatever the shell set
    wins, prompts, _ = heldout_data(EvalArgs(model=str(CKPT), windows=1, prompts=10, max_tokens=TOKENS))
    rows = _rows("fp8_ds_mla", ("fp8_act", "cpu_ref", "fp32_head"), wins, prompts) + _rows("bf16", ("cpu_ref",),
                                                                                       wins, prompts)
    print(f"\n{len(prompts)} held-out prompts x {TOKENS} greedy tokens; partings: prompt@step, top-1 margin of the "
          "setting / of the reference (nats)")
    print("\n".join(map(_show, rows)))
    assert len(rows) == 9 and all(r["partings"] == [] or "margin" in r["partings"][0] for r in rows)
    # the float32 lm_head rows are printed, not asserted: not yet measured on a GPU
    gpu_vs_cpu = [r for r in rows if r["setting"] in ("cuda:fp8_ds_mla", "cuda:bf16")
                  and r["reference"].startswith("cpu")]
    assert len(prompts) == 10 and len(gpu_vs_cpu) == 4
    for r in gpu_vs_cpu:
        assert _agreeing(r) >= 9, _show(r)
        assert abs(r["ppl_change_pct"]) < 1.0, r


def test_gpu_path_in_float32_gives_the_cpu_references_greedy_tokens(set_switch):
    """The issue's criterion where bf16 rounding does not decide it: the GPU path computing in float32 (FP8
    activations off; the same FP8 weights and fp8_ds_mla KV bytes) against the CPU reference: identical greedy
    tokens on >= 9 of 10 held-out prompts x 32 (the CPU's own fp32 runs with two KV layouts gave 9/10)."""
    set_switch("DSASERVE_KERNELS", None)
    wins, prompts, _ = heldout_data(EvalArgs(model=str(CKPT), windows=1, prompts=10, max_tokens=TOKENS))
    [row] = _rows("fp8_ds_mla", ("gpu_fp32",), wins, prompts)
    print("\n" + _show(row))
    assert row["setting"] == "cuda:fp8_ds_mla:float32" and row["reference"] == "cpu:fp8_ds_mla"
    assert row["identical"] >= 9, _show(row)
    assert abs(row["ppl_change_pct"]) < 0.5, row
