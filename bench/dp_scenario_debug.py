"""The DP-attention GPU test's scenario (tests/distributed/dp_harness.py), request by request: every step's
relative logit distance of each rank's requests to one GPU's, against a reference run with CUDA graphs and one
without, and the two references against each other (a diagnostic for two GPUs; the test only says pass/fail).

    PYTHONPATH=. python bench/dp_scenario_debug.py [--config glm-5.3-tiny]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch

from tests.distributed.dp_harness import OWNED, _prefill_rows, dp_worker
from tests.distributed.harness import reference, spawn

GPU = {"device": "cuda", "dtype": "bfloat16", "num_pages": 32, "cuda_graph_max_bs": 4}
if os.environ.get("DP_DEBUG_CPU") == "1":  # a smoke run on gloo
    GPU = {"device": "cpu", "dtype": "float32", "num_pages": 32}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-9))


def _rows(ref: dict, cfg, req: int, what: tuple) -> torch.Tensor:
    if what[0] == "prefill":
        return ref["logits"][0][_prefill_rows(cfg, [req])]
    return ref["logits"][1 + what[1]][req:req + 1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="glm-5.3-tiny")
    p.add_argument("--decode", type=int, default=3)
    name = p.parse_args().config
    from dsaserve.config import load_config

    cfg = load_config(name)
    graphs, tokens = reference(name, p.parse_args().decode, **GPU)
    eager, _ = reference(name, p.parse_args().decode, **GPU, disable_cuda_graph=True)
    for i, (a, b) in enumerate(zip(graphs["logits"], eager["logits"], strict=True)):
        print(f"reference step {i}: graphs vs eager rel {_rel(a, b):.4f}")
    out = Path(tempfile.mkdtemp())
    spawn(dp_worker, 2, {name: tokens}, str(out), GPU)
    for rank in range(2):
        steps = torch.load(out / f"rank{rank}.pt", weights_only=False)[name]["steps"]
        for i, s in enumerate(steps):
            if s["what"][0] not in ("prefill", "decode"):
                continue
            reqs = OWNED[rank]
            parts, start = [], 0
            for r in reqs:
                want = _rows(graphs, cfg, r, s["what"])
                got = s["logits"][start:start + want.shape[0]]
                start += want.shape[0]
                parts.append(f"req {r}: vs graphs {_rel(got, want):.4f} vs eager "
                             f"{_rel(got, _rows(eager, cfg, r, s['what'])):.4f}")
            print(f"rank {rank} step {i} {s['what']}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
