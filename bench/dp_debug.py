"""Where DP-attention's fast path leaves one GPU's numbers (a diagnostic for two GPUs): every layer's attention
and MLP outputs of one prompt's prefill on rank 0 of DP2+EP2 (rank 1 idle) against one GPU's, printed as
relative L2 distances, first layer first.   PYTHONPATH=. python bench/dp_debug.py [--config glm-5.3-tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dsaserve.common.wire import free_port
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import contiguous_batch

KW = {"device": "cuda", "dtype": "bfloat16", "kv_layout": "fp32", "num_pages": 32, "disable_cuda_graph": True}


def capture(runner: ModelRunner) -> dict:
    seen: dict = {}
    for i, layer in enumerate(runner.model.model.layers[: runner.cfg.num_hidden_layers]):
        for part in ("self_attn", "mlp"):
            getattr(layer, part).register_forward_hook(
                lambda m, a, out, key=f"{i}.{part}": seen.__setitem__(key, (out[0] if isinstance(out, tuple)
                                                                              else out).float().cpu()))
    prompt = [(5 * j) % 400 + 7 for j in range(40)]
    batch = contiguous_batch([prompt], [0], [0])
    batch.logits_indices = torch.arange(len(prompt))
    seen["logits"] = runner.forward(batch).float().cpu()
    return seen


def dp_rank(rank: int, port: int, config: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    runner = ModelRunner.from_kwargs(config, expert_parallel_size=2, enable_dp_attention=True, rank=rank,
                                     dist_init_method=f"tcp://127.0.0.1:{port}", **KW)
    if rank == 0:
        torch.save(capture(runner), Path(out) / "dp.pt")
    else:
        runner.forward_idle()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="glm-5.3-tiny")
    p.add_argument("--single", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.single:
        torch.save(capture(ModelRunner.from_kwargs(args.config, **KW)), Path(args.single) / "one.pt")
        return
    out = tempfile.mkdtemp()
    os.system(f"{sys.executable} {__file__} --config {args.config} --single {out}")  # its own process group
    mp.spawn(dp_rank, args=(free_port(), args.config, out), nprocs=2, join=True)
    one, dp = torch.load(Path(out) / "one.pt"), torch.load(Path(out) / "dp.pt")
    for key in one:
        a, b = one[key], dp[key]
        print(f"{key:>14}: rel L2 {float((a - b).norm() / a.norm().clamp_min(1e-9)):.4f}")


if __name__ == "__main__":
    main()
