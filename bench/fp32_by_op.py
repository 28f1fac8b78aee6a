"""Which GPU kernel moves the float32 GPU path off the CPU reference, op by op.

`dsaserve eval --groups gpu_fp32` (and tests/quality/test_gpu_vs_cpu.py) compares the GPU path computing in
float32 (FP8 activations off, the same FP8 weights and KV bytes) with the CPU reference: what is left should be
the order of float32 sums. When it is not, this runs the same comparison with registry ops swapped back to their
reference (`kernels/reference.py`, run on the GPU) one set at a time, and prints for each: the prefill logits'
distance from the CPU's at every prompt position, and the greedy agreement (eval's own `compare`). The set
whose swap brings the distance down to the float32 floor is the one that computes in something else.

    PYTHONPATH=. python bench/fp32_by_op.py --out /tmp/fp32_by_op.json
"""

from __future__ import annotations

import argparse
import json

import torch

from dsaserve.common import envs
from dsaserve.engine.kv_pool import PAGE_SIZE
from dsaserve.kernels import reference, registry
from dsaserve.model.forward_batch import contiguous_batch
from dsaserve.quality.report import EvalArgs, compare, heldout_data
from dsaserve.quality.runs import Setting, open_runner, page_bases, run_setting
from dsaserve.weights.checkpoint_cache import packaged_checkpoint

SWAPS = {
    "none": (),
    "indexer": ("indexer_topk",),
    "sparse_mla": ("sparse_mla_attention",),
    "linear": ("fp8_linear",),
    "moe": ("fused_moe",),
    "heads": ("head_bmm",),
    "router": ("router_logits", "small_linear", "moe_route"),
    "writes": ("mla_kv_write", "indexer_k_write", "indexer_k_norm_write"),
    "elementwise": ("rms_norm", "add_rms_norm", "silu_and_mul", "rope_inplace", "apply_rope"),
    "all": registry.OPS,
}


@torch.no_grad()
def prompt_logits(model_dir: str, s: Setting, prompts: list[list[int]]) -> torch.Tensor:
    """float32 logits [every prompt position, V] of one prefill of all prompts, on the host."""
    with envs.override(DSASERVE_FP8_ACTIVATIONS="1" if s.fp8_act else "0"):  # as run_setting's runner
        runner = open_runner(model_dir, s, sum(len(p) + PAGE_SIZE for p in prompts))
        b = contiguous_batch(prompts, [0] * len(prompts), page_bases([len(p) for p in prompts]))
        b.logits_indices = torch.arange(b.num_tokens)
        logits, _ = runner.model(b.to(runner.device), runner.kv_pool)
    return logits.float().cpu()


def swapped(names: tuple[str, ...]):
    """registry._gpu_ops with `names` bound to the reference."""
    base = registry._gpu_ops

    def ops(device):
        return {**base(device), **{n: (getattr(reference, n), "reference") for n in names}}
    return ops


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(packaged_checkpoint("glm-5.3-mini")))
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--kv-layout", default="fp8_ds_mla")
    ap.add_argument("--swaps", default=",".join(SWAPS), help=f"comma-separated, of: {', '.join(SWAPS)}")
    ap.add_argument("--device", default="cuda", help="cpu: the CPU's own ops on both sides (a smoke run)")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    wins, prompts, _ = heldout_data(EvalArgs(model=a.model, windows=1, prompts=a.prompts, max_tokens=a.tokens))
    cpu = Setting(f"cpu:{a.kv_layout}", "cpu", a.kv_layout)
    ref = run_setting(a.model, cpu, wins[:1], prompts, a.tokens, 1)
    ref_logits = prompt_logits(a.model, cpu, prompts)
    gpu = Setting(f"{a.device}:{a.kv_layout}:float32", a.device, a.kv_layout, dtype="float32", fp8_act=False)
    original, report = registry._gpu_ops, []
    print(f"prompt lengths {[len(p) for p in prompts]}, logits std {ref_logits.std():.3f}")
    for name in a.swaps.split(","):
        registry._gpu_ops, _ = swapped(SWAPS[name]), registry._CACHE.clear()
        try:
            res = run_setting(a.model, gpu, wins[:1], prompts, a.tokens, 1)
            with_logits = prompt_logits(a.model, gpu, prompts)
        finally:
            registry._gpu_ops, _ = original, registry._CACHE.clear()
        d = (with_logits - ref_logits).abs()
        [row] = compare({gpu.name: res, cpu.name: ref}, [("gpu fp32 vs cpu", gpu.name, cpu.name)])
        out = {"swap": name, "ops": list(SWAPS[name]), "max_abs": float(d.max()), "mean_abs": float(d.mean()),
               "identical": row["identical"], "of": row["of"], "ppl_change_pct": row["ppl_change_pct"],
               "partings": row["partings"]}
        report.append(out)
        parts = ", ".join(f"#{p['prompt']}@{p['step']} {p['margin']:.3f}/{p['ref_margin']:.3f}"
                          for p in row["partings"])
        print(f"{name:12} logits max |d| {out['max_abs']:.2e} mean {out['mean_abs']:.2e}  greedy "
              f"{row['identical']}/{row['of']}  ppl {row['ppl_change_pct']:+.3f}%  partings {parts or '-'}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
