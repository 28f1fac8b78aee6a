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
if os.environ.get("DP_DEBUG_CPU") == "1":  # a smoke run of this script on gloo (no GPU numerics)
    KW.update(device="cpu", dtype="float32")


def _first_tensor(out):
    while isinstance(out, (tuple, list)) and out:
        out = out[0]
    return out.float().cpu() if isinstance(out, torch.Tensor) else None


def _remember(seen: dict, key: str, args, out) -> None:
    """First call only; returns None so the hook never replaces the module's output."""
    seen.setdefault(key + ":in", _first_tensor(args))
    seen.setdefault(key, _first_tensor(out))


PROMPT = [(5 * j) % 400 + 7 for j in range(40)]


def capture(runner: ModelRunner, granular: int = 0, decode: bool = False) -> dict:
    """Every layer's attention / MLP output; with `granular` N, every submodule of the first N layers too
    (inputs and outputs, first call only: where the first difference is born)."""
    seen: dict = {}
    for i, layer in enumerate(runner.model.model.layers[: runner.cfg.num_hidden_layers]):
        for part in ("self_attn", "mlp"):
            getattr(layer, part).register_forward_hook(
                lambda m, a, out, key=f"{i}.{part}": seen.__setitem__(key, _first_tensor(out)))
        if i < granular:
            for name, mod in layer.named_modules():
                if not name:
                    continue
                mod.register_forward_hook(lambda m, a, out, key=f"{i}.{name}": _remember(seen, key, a, out))
    seen["logits"] = _prefill_then_decode(runner, PROMPT, seen if decode else None)
    return {k: v for k, v in seen.items() if v is not None}


def _prefill_then_decode(runner: ModelRunner, prompt: list[int], seen: dict | None) -> torch.Tensor:
    """Prefill's logits; with `seen`, also one decode step after it, whose hooks replace the prefill's."""
    batch = contiguous_batch([prompt], [0], [0])
    batch.logits_indices = torch.arange(len(prompt))
    logits = runner.forward(batch).float().cpu()
    if seen is None:
        return logits
    seen.clear()
    return runner.forward(contiguous_batch([[11]], [len(prompt)], [0])).float().cpu()


def dp_rank(rank: int, port: int, config: str, out: str, granular: int, decode: bool, both: bool) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    runner = ModelRunner.from_kwargs(config, expert_parallel_size=2, enable_dp_attention=True, rank=rank,
                                     dist_init_method=f"tcp://127.0.0.1:{port}", **KW)
    if rank == 0:
        torch.save(capture(runner, granular, decode), Path(out) / "dp.pt")
    elif both:  # rank 1 has work of its own: the MoE exchanges carry both ranks' tokens
        _prefill_then_decode(runner, [(3 * j) % 300 + 5 for j in range(24)], {} if decode else None)
    else:
        for _ in range(1 + decode):
            runner.forward_idle()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="glm-5.3-tiny")
    p.add_argument("--granular", type=int, default=0, help="also hook every submodule of the first N layers")
    p.add_argument("--decode", action="store_true", help="compare one decode step after the prefill")
    p.add_argument("--both", action="store_true", help="rank 1 runs a prompt of its own instead of idling")
    p.add_argument("--single", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.single:
        runner = ModelRunner.from_kwargs(args.config, **KW)
        torch.save(capture(runner, args.granular, args.decode), Path(args.single) / "one.pt")
        return
    out = tempfile.mkdtemp()
    flags = f"--config {args.config} --granular {args.granular}" + " --decode" * args.decode
    os.system(f"{sys.executable} {__file__} {flags} --single {out}")  # its own process group
    mp.spawn(dp_rank, args=(free_port(), args.config, out, args.granular, args.decode, args.both), nprocs=2,
             join=True)
    one, dp = torch.load(Path(out) / "one.pt"), torch.load(Path(out) / "dp.pt")
    for key in one:
        a, b = one[key], dp.get(key)
        if b is None or a.shape != b.shape:
            print(f"{key:>40}: shapes {tuple(a.shape)} vs {None if b is None else tuple(b.shape)}")
            continue
        print(f"{key:>40}: rel L2 {float((a - b).norm() / a.norm().clamp_min(1e-9)):.4f}  |a| {float(a.norm()):.3g}")


if __name__ == "__main__":
    main()
