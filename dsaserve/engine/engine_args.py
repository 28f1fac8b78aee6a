"""EngineArgs: every knob of the in-process engine, with vLLM / SGLang names (startup chain input).

Owns: the defaults, the validation (errors name the command-line flag, e.g. `--max-num-batched-tokens`),
and the argparse mapping shared by `dsaserve generate` and `dsaserve serve` (`add_cli_args` /
`from_cli_args`), so a flag means the same thing everywhere. Pure Python: no torch import.

Scheduler limits (vLLM v1 semantics):
  max_num_batched_tokens  tokens computed in one step, decode and prefill together (the token budget)
  chunked_prefill_size    most prompt tokens one request computes in one step (SGLang's name); a longer
                          prompt is prefilled over several steps while the others keep decoding
  max_running_requests    requests holding KV pages at once (vLLM's max_num_seqs)
  max_model_len           context limit; default = the config's max_position_embeddings
KV pool size: `num_pages` (pages of 64 tokens) or `kv_cache_bytes`; neither -> the runner's default.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from dsaserve.common.kv_layout import DEFAULT_KV_LAYOUT, ENGINE_KV_LAYOUTS

DTYPES = ("float32", "bfloat16")
_STR_FIELDS = ("model", "dtype", "kv_layout", "device", "load_format")
DEVICES = ("cpu", "cuda")


def _arg(help_: str, default: Any = None, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help_, **kw})


@dataclass
class EngineArgs:
    model: str = _arg("checkpoint directory or built-in config name (made into a checkpoint on first use)",
                      "glm-5.3-tiny")
    dtype: str = _arg("compute dtype of the model", "float32", choices=DTYPES)
    kv_layout: str = _arg("KV cache byte layout", DEFAULT_KV_LAYOUT, choices=ENGINE_KV_LAYOUTS)
    num_pages: int | None = _arg("KV pool size in pages of 64 tokens (default: from --kv-cache-bytes or "
                                 "the runner's default)")
    kv_cache_bytes: int | None = _arg("KV pool size in bytes (main KV + indexer K)")
    max_num_batched_tokens: int = _arg("token budget of one step (decode + prefill)", 2048)
    chunked_prefill_size: int | None = _arg("most prompt tokens one request prefills per step "
                                            "(default: --max-num-batched-tokens)")
    max_running_requests: int = _arg("requests holding KV pages at once", 128)
    max_model_len: int | None = _arg("context limit in tokens (default: the config's max_position_embeddings)")
    enable_prefix_caching: bool = _arg("share full KV pages between requests with the same prefix", True)
    device: str | None = _arg("cpu or cuda (default: cuda if available)", choices=DEVICES)
    seed: int = _arg("engine seed: weights of built-in models, and sampling of requests without a seed", 0)
    # device side (passed to the ModelRunner; the memory profile and CUDA graphs only run on cuda)
    load_format: str = _arg("auto: read the checkpoint; dummy: random weights of the real shapes", "auto",
                            choices=("auto", "dummy"))
    mem_fraction_static: float = _arg("fraction of GPU memory for weights + KV pool (memory profile)", 0.88,
                                      type=float)
    cuda_graph_max_bs: int = _arg("largest decode batch captured in a CUDA graph", 64)
    disable_cuda_graph: bool = _arg("run every decode step eagerly", False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the flag of the first bad value."""
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("--model: must be a checkpoint directory or a built-in config name")
        for f in fields(self):
            choices = f.metadata.get("choices")
            v = getattr(self, f.name)
            if choices and v is not None and v not in choices:
                raise ValueError(f"{flag(f.name)}: {v!r} is not one of {', '.join(choices)}")
        for name in ("num_pages", "kv_cache_bytes", "chunked_prefill_size", "max_model_len"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_running_requests", self.max_running_requests)
        _positive("cuda_graph_max_bs", self.cuda_graph_max_bs)
        if isinstance(self.mem_fraction_static, bool) or not isinstance(self.mem_fraction_static, (int, float)) \
                or not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static: must be in (0, 1), got {self.mem_fraction_static!r}")
        if self.num_pages is not None and self.kv_cache_bytes is not None:
            raise ValueError("--num-pages and --kv-cache-bytes both set: give one of them")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size > self.max_num_batched_tokens:
            raise ValueError(f"--chunked-prefill-size: {self.chunked_prefill_size} exceeds "
                             f"--max-num-batched-tokens {self.max_num_batched_tokens}")
        for name in ("enable_prefix_caching", "disable_cuda_graph"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{flag(name)}: must be a boolean, got {getattr(self, name)!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"--seed: must be an integer, got {self.seed!r}")

    @property
    def chunk_size(self) -> int:
        return self.chunked_prefill_size or self.max_num_batched_tokens

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch  # only here: keeps the class importable without torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    # ---- command line --------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one `--flag` per field (bools as --x / --no-x); `skip` leaves fields to the caller."""
        for f in fields(cls):
            if f.name in skip:
                continue
            default = f.default if f.default is not MISSING else None
            kw: dict[str, Any] = {"default": default, "help": f.metadata["help"], "dest": f.name}
            if isinstance(default, bool):
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = f.metadata.get("type") or (str if f.name in _STR_FIELDS else int)
                if f.metadata.get("choices"):
                    kw["choices"] = f.metadata["choices"]
            parser.add_argument(flag(f.name), **kw)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
        kw = {f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)}
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_kwargs(cls, **kw: Any) -> EngineArgs:
        """Like EngineArgs(**kw) but an unknown name is a ValueError that lists the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kw) - known)
        if unknown:
            raise ValueError(f"unknown engine argument {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**kw)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{flag(name)}: must be a positive integer, got {v!r}")
