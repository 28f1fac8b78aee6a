"""Checkpoint variants for the attention comparisons of `dsaserve eval`.

Owns: directories that hold a checkpoint's files as symlinks with a changed config.json:
  - `dense`: index_topk = the longest sequence evaluated (a power of two >= it), so the indexer keeps every
    causal key (top-k >= context) without making the kernels carry max_position_embeddings slots per query;
  - `all_full`: every layer "full". A shared layer has no indexer weights of its own, so it gets a copy of
    the weights of the full layer whose top-k it reused (an extra shard, the index updated): each layer
    then selects with its own hidden state instead of inheriting the selection. This is the question
    "does reusing the top-k lose anything", asked with the only indexer weights the model has.
The variant is rebuilt each time (cheap: links and, for all_full, a few small tensors).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from dsaserve.weights.checkpoint_check import INDEX_FILE

VARIANTS = ("base", "dense", "all_full")
EXTRA_SHARD = "model-variant-indexers.safetensors"


def _link_all(src: Path, dst: Path, skip: tuple[str, ...]) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name not in skip:
            (dst / f.name).symlink_to(f.resolve())


def make_variant(ckpt: str | Path, variant: str, root: str | Path, context: int = 0) -> Path:
    """The directory of `variant` of checkpoint `ckpt` under root (`base` is ckpt itself); `context`: the
    longest sequence the variant will see (dense only; 0 = max_position_embeddings)."""
    ckpt = Path(ckpt)
    if variant == "base":
        return ckpt
    if variant not in VARIANTS:
        raise ValueError(f"variant: {variant!r} not one of {', '.join(VARIANTS)}")
    raw = json.loads((ckpt / "config.json").read_text())
    dst = Path(root) / f"{ckpt.name}-{variant}"
    if variant == "dense":
        _link_all(ckpt, dst, ("config.json",))
        ctx = min(context or int(raw["max_position_embeddings"]), int(raw["max_position_embeddings"]))
        raw["index_topk"] = max(int(raw["index_topk"]), 1 << max(ctx - 1, 1).bit_length())
    else:
        _link_all(ckpt, dst, ("config.json", INDEX_FILE))
        _copy_indexers(ckpt, dst, raw)
        raw["indexer_types"] = ["full"] * int(raw["num_hidden_layers"])
    (dst / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
    return dst


def _copy_indexers(ckpt: Path, dst: Path, raw: dict) -> None:
    """Give every shared layer the indexer tensors (bytes as stored: FP8 + scales) of its full layer."""
    index = json.loads((ckpt / INDEX_FILE).read_text())
    weight_map = dict(index["weight_map"])
    types = raw.get("indexer_types") or []
    extra, full = {}, None
    for layer, kind in enumerate(types):
        if kind == "full":
            full = layer
            continue
        prefix = f"model.layers.{full}.self_attn.indexer."
        for name, shard in index["weight_map"].items():
            if name.startswith(prefix):
                with safe_open(str(ckpt / shard), framework="pt") as f:
                    t = f.get_tensor(name)
                new = name.replace(f"model.layers.{full}.", f"model.layers.{layer}.", 1)
                extra[new] = t.clone()
                weight_map[new] = EXTRA_SHARD
    if extra:
        save_file(extra, str(dst / EXTRA_SHARD), metadata={"format": "pt"})
    total = index["metadata"]["total_size"] + sum(t.numel() * t.element_size() for t in extra.values())
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=2, sort_keys=True) + "\n")
