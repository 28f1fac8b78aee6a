"""How far each path's logits are from the fp32 CPU reference on the tiny configs (issue 5, greedy target).

Run on the device:  PYTHONPATH=. python bench/logit_distance.py
For a few prompts, the last-position logits of one prefill on: the CPU reference in bf16 (bf16 KV), the GPU
path in bf16 (bf16 KV; FP8 activations on and off), all against the CPU reference in fp32 (fp32 KV). If the
GPU path sits as close to fp32 as the CPU's own bf16 run does, greedy disagreements between the bf16 paths
are bf16 rounding amplified by the random checkpoint, not a GPU error.
"""

from __future__ import annotations

import os
import random

import torch

from dsaserve.common import envs
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import contiguous_batch


def last_logits(model: str, device: str, dtype: str, layout: str, prompts: list[list[int]]) -> torch.Tensor:
    runner = ModelRunner.from_kwargs(model, dtype=dtype, kv_layout=layout, device=device, num_pages=16,
                                     disable_cuda_graph=True)
    return torch.cat([runner.forward(contiguous_batch([p], [0], [0], runner.page_size)).float().cpu()
                      for p in prompts])


def main() -> None:
    r = random.Random(0)
    prompts = [[r.randrange(2, 512) for _ in range(r.randrange(5, 200))] for _ in range(8)]
    for model in ("glm-5.3-tiny", "deepseek-v3.2-tiny"):
        ref = last_logits(model, "cpu", "float32", "fp32", prompts)
        runs = {"cpu bf16": last_logits(model, "cpu", "bfloat16", "bf16", prompts)}
        for act in ("1", "0"):
            os.environ["DSASERVE_FP8_ACTIVATIONS"] = act
            envs.reload()  # switches are read once; this A/B flips one between runs
            runs[f"gpu bf16 fp8_act={act}"] = last_logits(model, "cuda", "bfloat16", "bf16", prompts)
        os.environ.pop("DSASERVE_FP8_ACTIVATIONS", None)
        envs.reload()
        for name, got in runs.items():
            d = (got - ref).abs().amax(-1)
            same = (got.argmax(-1) == ref.argmax(-1)).sum().item()
            print(f"{model} {name:22s}: max|dlogit| vs fp32 per prompt mean {d.mean():.3f} max {d.max():.3f}; "
                  f"argmax = fp32's {same}/{len(prompts)}; logit std {ref.std():.2f}", flush=True)


if __name__ == "__main__":
    main()
