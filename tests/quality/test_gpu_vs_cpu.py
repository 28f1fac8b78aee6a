"""The GPU path against the CPU reference on the trained built-in model (issue 18), as `dsaserve eval` asks it.

glm-5.3-mini, 10 held-out prompts x 32 greedy tokens, both with the engine's default fp8_ds_mla KV layout: the
GPU path (bf16, the Triton kernels, FP8 activations on) must continue >= 9 of 10 prompts exactly as the CPU
reference (fp32 on dequantised weights). Printed beside it, each with every parting's step and both runs' top-1
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


def test_gpu_greedy_equals_the_cpu_reference_on_9_of_10_heldout_prompts(set_switch):
    set_switch("DSASERVE_KERNELS", None)  # the default kernels, whatever the shell set
    wins, prompts, _ = heldout_data(EvalArgs(model=str(CKPT), windows=1, prompts=10, max_tokens=TOKENS))
    rows = _rows("fp8_ds_mla", ("fp8_act", "cpu_ref"), wins, prompts) + _rows("bf16", ("cpu_ref",), wins, prompts)
    print(f"\n{len(prompts)} held-out prompts x {TOKENS} greedy tokens; partings: prompt@step, top-1 margin of the "
          "setting / of the reference (nats)")
    print("\n".join(map(_show, rows)))
    main = next(r for r in rows if r["setting"] == "cuda:fp8_ds_mla" and r["reference"] == "cpu:fp8_ds_mla")
    assert len(rows) == 7 and all(r["partings"] == [] or "margin" in r["partings"][0] for r in rows)
    assert len(prompts) == 10 and main["identical"] >= 9, main
