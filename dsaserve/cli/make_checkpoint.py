"""`dsaserve make-checkpoint`: write a random-weight checkpoint in the real HF FP8 layout.

Owns: the command-line surface of `weights.checkpoint_writer` (flags, refusing to clobber a directory,
the report of what was written). Startup chain: run once, before `serve` / `generate` load the result.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from dsaserve.config import ConfigError, load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("make-checkpoint", help="write a random-weight checkpoint in the real HF FP8 layout",
                              description="Write config.json, generation_config.json, FP8 safetensors shards + "
                                          "index, and a tokenizer, with random weights from --seed.")
    p.add_argument("--config", required=True, help="built-in config name (e.g. glm-5.3-tiny) or a config.json path")
    p.add_argument("--out", required=True, type=Path, help="output directory (must be empty or missing)")
    p.add_argument("--seed", type=int, default=0, help="random seed; the same seed gives byte-identical files")
    p.add_argument("--num-shards", type=int, default=None, help="number of safetensors shards (default: ~5 GB each, "
                                                                 "at least 2)")
    p.add_argument("--force", action="store_true", help="write into a non-empty --out, replacing a checkpoint there")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"dsaserve make-checkpoint: error: {msg}", file=sys.stderr)
    return 2


def _clear_checkpoint_files(out: Path) -> None:
    """--force: remove old shards; ones from a different --num-shards would otherwise sit beside the new index."""
    for f in out.glob("model-*-of-*.safetensors"):
        f.unlink()


def run(args: argparse.Namespace) -> int:
    # Heavy imports (torch) only once the command is chosen, so `dsaserve --help` stays fast.
    from dsaserve.weights.checkpoint_writer import plan_shards, summarize_checkpoint, write_checkpoint

    if args.seed < 0:
        return _fail(f"--seed: must be non-negative, got {args.seed}")
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        return _fail(f"--config: {e}")
    out: Path = args.out
    if out.exists() and not out.is_dir():
        return _fail(f"--out: {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not args.force:
            return _fail(f"--out: {out} is not empty (use --force to write a checkpoint into it)")
        _clear_checkpoint_files(out)
    try:
        plan = plan_shards(cfg, args.num_shards)
    except ValueError as e:
        return _fail(f"--num-shards: {str(e).removeprefix('num_shards: ')}")
    total = sum(s.nbytes for shard in plan for s in shard)
    probe = out if out.exists() else next(p for p in out.absolute().parents if p.exists())
    free = shutil.disk_usage(probe).free
    if free < total:
        return _fail(f"--out: the checkpoint needs {total / 1e9:.2f} GB, {probe} has {free / 1e9:.2f} GB free")
    try:
        write_checkpoint(cfg, out, seed=args.seed, num_shards=args.num_shards)
    except ValueError as e:  # e.g. a config whose ids do not fit the built-in tokenizer
        return _fail(str(e))
    s = summarize_checkpoint(out)
    print(f"wrote {cfg.name or args.config} (seed {args.seed}) to {out}: {s.num_tensors} tensors, "
          f"{s.total_bytes:,} bytes ({s.total_bytes / 1e9:.3f} GB) in {len(s.shards)} shards")
    for name in s.shards:
        print(f"  {name}  {(out / name).stat().st_size:,} bytes")
    return 0
