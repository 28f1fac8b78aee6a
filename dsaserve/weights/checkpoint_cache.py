"""`--model` resolution: a checkpoint directory, or a built-in config made into a cached checkpoint.

Owns: turning the user's `--model` value into a directory the loader can read. Startup chain: the very
first step of `serve` / `generate` (before the config is parsed). A built-in name (`glm-5.3-tiny`, ...)
is written once with `write_checkpoint(seed=0)` under `$DSASERVE_CACHE_DIR/checkpoints/<name>-seed0`
(default ~/.cache/dsaserve); later runs reuse it. Writing is atomic (temp dir, then rename) and guarded
by a file lock so concurrent processes (several ranks, parallel tests) write it once. A cached copy whose
config.json or writer stamp no longer matches (a built-in config was edited) is rebuilt.
Full-size built-ins (~755 GB for glm-5.3) are refused: random weights for those come from
`--load-format dummy`, which needs no files.
A built-in with *trained* weights shipped inside the package (`dsaserve/builtin/<name>/`, e.g. glm-5.3-mini
from bench/train_builtin.py) resolves to that directory as is; without those files it falls back to the
random seed-0 checkpoint of its config, like any other built-in.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dsaserve.common import envs
from dsaserve.common.envs import cache_root
from dsaserve.config import builtin_config_names, load_config
from dsaserve.errors import CheckpointError
from dsaserve.weights.checkpoint_check import INDEX_FILE
from dsaserve.weights.spec import checkpoint_specs
from dsaserve.weights.tokenizer_builder import write_tokenizer

CACHE_ENV = "DSASERVE_CACHE_DIR"
MAX_GB_ENV = "DSASERVE_MAX_CHECKPOINT_GB"
DEFAULT_MAX_GB = 16.0  # fits glm-5.3-slice (10.7 GB) and the tiny configs; refuses the full models
CACHE_SEED = 0
STAMP_FILE = "dsaserve_checkpoint.json"
WRITER_VERSION = 2  # bump when checkpoint_writer's values or layout change, so caches rebuild (2: tokenizers)
BUILTIN_ROOT = Path(__file__).resolve().parent.parent / "builtin"  # trained checkpoints shipped in the package


class CheckpointResolveError(CheckpointError):
    """--model names neither a checkpoint directory nor a built-in config that can be cached."""


def write_checkpoint(*args: Any, **kwargs: Any) -> Any:
    """checkpoint_writer.write_checkpoint, imported on the first write: the writer needs torch and
    safetensors, and this module runs in `dsaserve serve`'s HTTP process, which must start without them
    (seconds of import) whenever the checkpoint is already cached."""
    from dsaserve.weights.checkpoint_writer import write_checkpoint as write

    return write(*args, **kwargs)


def _max_bytes() -> float:
    raw = envs.DSASERVE_MAX_CHECKPOINT_GB
    if raw is None:
        return DEFAULT_MAX_GB * 1e9
    try:
        return float(raw) * 1e9
    except ValueError:
        raise CheckpointResolveError(f"{MAX_GB_ENV}: expected a number of GB, got {raw!r}") from None


def _stamp(name: str) -> dict:
    return {"config": name, "seed": CACHE_SEED, "writer_version": WRITER_VERSION}


def _is_current(path: Path, name: str, config_json: str) -> bool:
    try:
        return ((path / INDEX_FILE).is_file()
                and (path / "config.json").read_text() == config_json
                and json.loads((path / STAMP_FILE).read_text()) == _stamp(name))
    except (OSError, ValueError):
        return False


@contextmanager
def _file_lock(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(name: str, cache: dict | None = None) -> Path:
    cfg = load_config(name)
    total = sum(s.nbytes for s in checkpoint_specs(cfg))
    limit = _max_bytes()
    if total > limit:
        raise CheckpointResolveError(
            f"model: built-in config {name!r} would need a {total / 1e9:.1f} GB random checkpoint, over the "
            f"{limit / 1e9:.1f} GB cache limit ({MAX_GB_ENV}); use --load-format dummy for random weights "
            f"without files, or write one with `dsaserve make-checkpoint --config {name} --out DIR`")
    root = cache_root() / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    target = root / f"{name}-seed{CACHE_SEED}"
    config_json = cfg.to_json() + "\n"
    _note(cache, "checkpoint", "hit", target)
    if _is_current(target, name, config_json):
        return target
    with _file_lock(root / f".{target.name}.lock"):
        if _is_current(target, name, config_json):  # another process built it while we waited
            return target
        _note(cache, "checkpoint", "miss", target)
        free = shutil.disk_usage(root).free
        if free < total * 1.05:
            raise CheckpointResolveError(f"model: {name!r} needs {total / 1e9:.1f} GB in {root}, "
                                         f"only {free / 1e9:.1f} GB free (set {CACHE_ENV} elsewhere)")
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
        try:
            write_checkpoint(cfg, tmp, seed=CACHE_SEED)
            (tmp / STAMP_FILE).write_text(json.dumps(_stamp(name), sort_keys=True) + "\n")
            if target.exists():  # stale: move aside first, so rename never merges into old files
                old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=root))
                target.rename(old / "ckpt")
                shutil.rmtree(old)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _note(cache: dict | None, kind: str, status: str, path: Path) -> None:
    """What resolution did, for the startup manifest: which cache, hit or miss (made now), where."""
    if cache is not None:
        cache.update(kind=kind, status=status, path=str(path))


def resolve_model_dir(model: str | os.PathLike, load_format: str = "auto", cache: dict | None = None) -> Path:
    """What the server's processes read: the checkpoint, or — for `--load-format dummy` with a built-in name —
    a directory with only its config.json and tokenizer (the full-size configs' weights would be ~0.7 TB).
    `cache`, when given, is filled with what happened: kind ("checkpoint", "config_and_tokenizer",
    "directory", "packaged"), status ("hit", "miss": made now, "not cached": the user's own directory) and path."""
    text = os.fspath(model)
    if load_format != "dummy" or Path(text).expanduser().is_dir() or text not in builtin_config_names():
        return resolve_checkpoint(model, cache)
    cfg = load_config(text)
    target = cache_root() / "configs" / text
    config_json = cfg.to_json() + "\n"
    _note(cache, "config_and_tokenizer", "hit", target)
    if not (target / "config.json").is_file() or (target / "config.json").read_text() != config_json:
        _note(cache, "config_and_tokenizer", "miss", target)
        target.mkdir(parents=True, exist_ok=True)
        with _file_lock(target.parent / f".{text}.lock"):
            write_tokenizer(cfg, target)
            (target / "config.json").write_text(config_json)
    return target


def resolve_checkpoint(model: str | os.PathLike, cache: dict | None = None) -> Path:
    """A directory with config.json as is; a built-in config name as its cached seed-0 checkpoint."""
    text = os.fspath(model)
    p = Path(text).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise CheckpointResolveError(f"model: directory {text!r} has no config.json, so it is not a checkpoint")
        _note(cache, "directory", "not cached", p)
        return p
    names = builtin_config_names()
    packaged = packaged_checkpoint(text)
    if packaged is not None:
        _note(cache, "packaged", "not cached", packaged)  # trained files shipped in the package: nothing to make
        return packaged
    if text in names:
        return _build(text, cache)
    raise CheckpointResolveError(f"model: {text!r} is neither a checkpoint directory (with config.json) nor a "
                                 f"built-in config ({', '.join(names)})")


def packaged_checkpoint(name: str) -> Path | None:
    """The trained checkpoint shipped as dsaserve/builtin/<name>/, if the package has one (config + index)."""
    if not name or "/" in name or name.startswith("."):
        return None
    p = BUILTIN_ROOT / name
    return p if (p / "config.json").is_file() and (p / INDEX_FILE).is_file() else None
