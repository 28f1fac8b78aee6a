"""Greedy outputs of the GPU path against the CPU reference path on the tiny configs (issue 5's last target).

Run on the device:  PYTHONPATH=. python bench/greedy_agreement.py --out $OUT
Both paths run the same checkpoint in bf16 with the bf16 KV layout; the GPU path once with its default
FP8 activations in the decode GEMMs and once with DSASERVE_FP8_ACTIVATIONS=0 (bf16 activations: the
reference's math up to summation order). Printed per config: sequences identical to the CPU's, and the
mean length of the common prefix. The random tiny checkpoints have near-tied logits, indexer scores and
router scores, so any rounding difference can flip an argmax (tests/engine/test_engine_real_model.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from dsaserve import Engine, SamplingParams
from dsaserve.common import envs

TOKENS = 16


def prompts(n: int, vocab: int) -> list[list[int]]:
    r = random.Random(0)
    return [[r.randrange(2, vocab) for _ in range(r.randrange(5, 200))] for _ in range(n)]


def greedy(model: str, device: str, ps: list[list[int]]) -> list[list[int]]:
    eng = Engine(model, device=device, dtype="bfloat16", kv_layout="bf16", num_pages=128, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    return [o.token_ids for o in eng.generate(ps, [params] * len(ps))]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--prompts", type=int, default=10)
    args = ap.parse_args()
    report = []
    for model in ("glm-5.3-tiny", "deepseek-v3.2-tiny"):
        ps = prompts(args.prompts, 512)
        ref = greedy(model, "cpu", ps)
        for fp8_act in ("1", "0"):
            os.environ["DSASERVE_FP8_ACTIVATIONS"] = fp8_act
            envs.reload()  # switches are read once; this A/B flips one between runs
            got = greedy(model, "cuda", ps)
            same = sum(a == b for a, b in zip(got, ref, strict=True))
            prefix = sum(common_prefix(a, b) for a, b in zip(got, ref, strict=True)) / len(ps)
            row = {"model": model, "fp8_activations": fp8_act == "1", "identical": same, "sequences": len(ps),
                   "mean_common_prefix": prefix, "tokens": TOKENS}
            report.append(row)
            print(f"{model} fp8_act={fp8_act}: {same}/{len(ps)} identical, mean common prefix {prefix:.1f}/{TOKENS}",
                  flush=True)
    os.environ.pop("DSASERVE_FP8_ACTIVATIONS", None)
    envs.reload()
    (args.out / "greedy_agreement.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
