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

Parallel layout (SGLang's flags; docs/PARALLELISM.md): world = max(tp, ep) ranks over `nnodes` machines.
  tensor_parallel_size (--tp)      attention / dense MLP / shared expert / vocab split over the world
  expert_parallel_size (--ep)      routed experts split over ep ranks
  enable_dp_attention              attention data-parallel: each rank schedules its own requests over its
                                   own KV pool; the MoE layers gather (decode, in CUDA graphs) or exchange
                                   (all-to-all) tokens across ranks, per step (--dp-moe)
  nnodes / node_rank / dist_init_addr   the same ranks over several machines (node 0 serves HTTP)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from dsaserve.common.kv_layout import DEFAULT_KV_LAYOUT, ENGINE_KV_LAYOUTS
from dsaserve.engine.warmup_plan import parse_buckets, piecewise_buckets


def no_gpu_present() -> bool:
    """True when torch could not see any GPU, known without importing it: CUDA_VISIBLE_DEVICES hides them
    all, or the machine has no NVIDIA device (/dev/nvidia<N>, /proc/driver/nvidia/gpus) and no ROCm
    (/dev/kfd). False means "maybe": then torch decides."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return True
    nvidia = Path("/proc/driver/nvidia/gpus")
    has_nvidia = any(Path("/dev").glob("nvidia[0-9]*")) or (nvidia.is_dir() and any(nvidia.iterdir()))
    return not has_nvidia and not Path("/dev/kfd").exists()

DTYPES = ("auto", "float32", "bfloat16")
_STR_FIELDS = ("model", "dtype", "kv_layout", "device", "load_format", "dist_init_addr", "precompile_schemas",
               "piecewise_cuda_graph_tokens", "dp_moe", "speculative_algorithm")
DEVICES = ("cpu", "cuda")
DP_MOE = ("auto", "gather", "a2a")  # engine/dp_step.py
SPECULATIVE = ("mtp", "nextn")  # the MTP layer drafts (engine/mtp.py); nextn: SGLang's name for it
MAX_SPECULATIVE_STEPS = 8  # each chained draft is one more MTP forward a step; past a few they are rarely kept


def _arg(help_: str, default: Any = None, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help_, **kw})


@dataclass
class EngineArgs:
    model: str = _arg("checkpoint directory or built-in name (glm-5.3-mini: the trained model shipped in the "
                      "package; a random-weight config such as glm-5.3-tiny: made into a checkpoint on first use)",
                      "glm-5.3-mini")
    dtype: str = _arg("compute dtype: auto = bfloat16 on cuda, float32 on cpu (the reference path)", "auto",
                      choices=DTYPES)
    kv_layout: str = _arg("KV cache byte layout", DEFAULT_KV_LAYOUT, choices=ENGINE_KV_LAYOUTS)
    num_pages: int | None = _arg("KV pool size in pages of 64 tokens (default: from --kv-cache-bytes or "
                                 "the runner's default)")
    kv_cache_bytes: int | None = _arg("KV pool size in bytes (main KV + indexer K)")
    max_num_batched_tokens: int = _arg("token budget of one step (decode + prefill)", 2048)
    chunked_prefill_size: int | None = _arg("most prompt tokens one request prefills per step "
                                            "(default: --max-num-batched-tokens)")
    max_running_requests: int = _arg("requests holding KV pages at once", 128)
    mixed_step_tokens: int | None = _arg(
        "token budget of a step that carries decodes: prompts prefill at most this minus the decode rows "
        "(at least a quarter of it), which bounds the inter-token latency a prefill adds (0 = no cap; "
        "default: the largest piecewise CUDA-graph bucket where those graphs run, so mixed steps replay one)")
    max_model_len: int | None = _arg("context limit in tokens (default: the config's max_position_embeddings)")
    enable_prefix_caching: bool = _arg("share full KV pages between requests with the same prefix", True)
    device: str | None = _arg("cpu or cuda (default: cuda if available)", choices=DEVICES)
    seed: int = _arg("engine seed: weights of built-in models, and sampling of requests without a seed", 0)
    # device side (passed to the ModelRunner; the memory profile and CUDA graphs only run on cuda)
    load_format: str = _arg("auto: read the checkpoint; dummy: random weights of the real shapes", "auto",
                            choices=("auto", "dummy"))
    mem_fraction_static: float = _arg("fraction of GPU memory for weights + KV pool (memory profile)", 0.88,
                                      type=float)
    cuda_graph_max_bs: int | None = _arg("largest decode batch captured in a CUDA graph (default: "
                                         "--max-running-requests, so every decode batch the scheduler forms has one; "
                                         "times 1 + --speculative-num-steps when drafting, for the verify rows)")
    disable_cuda_graph: bool = _arg("run every step eagerly (no decode or piecewise CUDA graphs)", False)
    disable_narrow_decode_graphs: bool = _arg(
        "capture the decode graphs at --max-model-len's page-table width only, not also at the indexer top-k's "
        "(which a decode batch of requests within index_topk tokens replays: no long-row selection, a narrow "
        "page-table copy) nor, for 1-2 rows, at 32K / 64K keys (a long request's fused selection)", False)
    disable_piecewise_cuda_graph: bool = _arg("run steps with a prefill part (mixed prefill + decode, prefill "
                                              "chunks) eagerly instead of on piecewise CUDA graphs", False)
    piecewise_cuda_graph_tokens: str | None = _arg(
        "token counts of the piecewise CUDA graphs, comma-separated (default: 8, 16, 32, every 64 to 512, then 4 "
        "per octave up to --max-num-batched-tokens; a step over the largest runs eagerly)")
    disable_overlap_schedule: bool | None = _arg(
        "step synchronously: schedule step N+1 only once step N's tokens are on the host (default: overlap on "
        "cuda, where the host prepares step N+1 while the GPU runs step N; off on cpu, where nothing runs "
        "asynchronously; --no-disable-overlap-schedule forces it on, as the CPU tests do)", bool_flag=True)
    load_mtp: bool = _arg("also load the MTP layer's weights", False)
    speculative_algorithm: str | None = _arg(
        "speculative decoding: mtp (SGLang's NEXTN, vLLM's deepseek_mtp method; nextn is taken too) drafts "
        "--speculative-num-steps tokens a step with the checkpoint's MTP layer and verifies them in the next decode "
        "step (engine/mtp.py): loads the MTP layer, steps synchronously, not with DP-attention", choices=SPECULATIVE)
    speculative_num_steps: int = _arg("drafts a request a step with --speculative-algorithm: the MTP layer once, then "
                                      "chained on its own output (SGLang's --speculative-num-steps)", 1)
    # parallel layout (one process per rank; validated against the model before any weight is read)
    tensor_parallel_size: int = _arg("tensor-parallel ranks", 1, aliases=("--tp", "--tp-size"))
    expert_parallel_size: int = _arg("expert-parallel ranks (routed experts split over them)", 1,
                                     aliases=("--ep", "--ep-size"))
    enable_dp_attention: bool = _arg("attention data-parallel over the ranks (each its own requests and KV "
                                     "pool); MoE tokens exchanged by all-to-all; needs --ep = the world size", False)
    dp_moe: str = _arg("DP-attention: how each step's MoE layers meet (engine/dp_step.py). auto: all-gather / "
                       "reduce-scatter of every rank's rows, inside the decode CUDA graphs when every rank decodes "
                       "within --cuda-graph-max-bs, else eager (every step the scheduler forms: the memory profile "
                       "sizes for it); the all-to-all exchange past that; gather / a2a: always that way",
                       "auto", choices=DP_MOE)
    moe_a2a: bool = _arg("routed experts via all-to-all dispatch/combine instead of one all-reduce (needs --ep "
                         "= the world size; implied by --enable-dp-attention)", False)
    nnodes: int = _arg("machines the ranks span", 1)
    node_rank: int = _arg("this machine's index among --nnodes (node 0 serves HTTP)", 0)
    dist_init_addr: str | None = _arg("host:port of node 0's torch.distributed rendezvous (default: a free "
                                      "port on 127.0.0.1; required with --nnodes > 1)")
    # structured output (engine/grammar.py)
    precompile_schemas: str | None = _arg("JSON file: a list of JSON schemas (or {\"kind\", \"value\"} specs) "
                                          "compiled into the grammar cache at startup")
    grammar_compile_timeout: float = _arg("seconds a grammar may take to compile before its request gets a 400",
                                          10.0, type=float)
    dist_timeout: float = _arg("seconds a rendezvous or a collective may wait before the rank fails", 600.0,
                               type=float)

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
        m = self.mixed_step_tokens
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 0):
            raise ValueError(f"--mixed-step-tokens: must be an integer >= 0 (0 = no cap), got {m!r}")
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_running_requests", self.max_running_requests)
        if self.cuda_graph_max_bs is not None:
            _positive("cuda_graph_max_bs", self.cuda_graph_max_bs)
        t = self.grammar_compile_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(f"--grammar-compile-timeout: must be a positive number of seconds, got {t!r}")
        if isinstance(self.mem_fraction_static, bool) or not isinstance(self.mem_fraction_static, (int, float)) \
                or not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static: must be in (0, 1), got {self.mem_fraction_static!r}")
        if self.num_pages is not None and self.kv_cache_bytes is not None:
            raise ValueError("--num-pages and --kv-cache-bytes both set: give one of them")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size > self.max_num_batched_tokens:
            raise ValueError(f"--chunked-prefill-size: {self.chunked_prefill_size} exceeds "
                             f"--max-num-batched-tokens {self.max_num_batched_tokens}")
        if self.precompile_schemas is not None and not os.path.isfile(self.precompile_schemas):
            raise ValueError(f"--precompile-schemas: {self.precompile_schemas} is not a file")  # before the load
        if self.piecewise_cuda_graph_tokens is not None:
            parse_buckets(str(self.piecewise_cuda_graph_tokens), "--piecewise-cuda-graph-tokens")
        for name in ("enable_prefix_caching", "disable_cuda_graph", "disable_piecewise_cuda_graph",
                     "disable_narrow_decode_graphs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{flag(name)}: must be a boolean, got {getattr(self, name)!r}")
        if self.disable_overlap_schedule is not None and not isinstance(self.disable_overlap_schedule, bool):
            raise ValueError(f"--disable-overlap-schedule: must be a boolean or None (auto), "
                             f"got {self.disable_overlap_schedule!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"--seed: must be an integer, got {self.seed!r}")
        self._validate_parallel()
        self._validate_speculative()

    def _validate_speculative(self) -> None:
        """What speculative decoding does not do yet, refused with the flags that ask for it."""
        _positive("speculative_num_steps", self.speculative_num_steps)
        if self.speculative_num_steps > MAX_SPECULATIVE_STEPS:
            raise ValueError(f"--speculative-num-steps: at most {MAX_SPECULATIVE_STEPS}, got "
                             f"{self.speculative_num_steps}")
        if self.speculative_algorithm is None:
            return
        if self.disable_overlap_schedule is False:
            raise ValueError("--speculative-algorithm: steps synchronously (its drafts need the step's tokens); "
                             "drop --no-disable-overlap-schedule")

    def _validate_parallel(self) -> None:
        from dsaserve.distributed.layout import check_sizes

        for name in ("enable_dp_attention", "moe_a2a", "load_mtp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{flag(name)}: must be a boolean, got {getattr(self, name)!r}")
        world = check_sizes(self.tensor_parallel_size, self.expert_parallel_size, self.enable_dp_attention,
                            flag("tensor_parallel_size"), flag("expert_parallel_size"), self.moe_a2a).world
        _positive("nnodes", self.nnodes)
        if world % self.nnodes:
            raise ValueError(f"--nnodes: {self.nnodes} does not divide the {world} ranks")
        if isinstance(self.node_rank, bool) or not isinstance(self.node_rank, int) \
                or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank: {self.node_rank!r} is not in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--dist-init-addr: required with --nnodes > 1 (host:port of node 0)")
        if self.dist_init_addr is not None:
            host, _, port = str(self.dist_init_addr).rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--dist-init-addr: {self.dist_init_addr!r} is not host:port")
        if isinstance(self.dist_timeout, bool) or not isinstance(self.dist_timeout, (int, float)) \
                or self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout: must be a positive number of seconds, got {self.dist_timeout!r}")

    @property
    def loads_mtp(self) -> bool:
        """Whether the MTP layer is built and read: --load-mtp, or speculative decoding (its drafter)."""
        return self.load_mtp or self.speculative_algorithm is not None

    @property
    def world_size(self) -> int:
        """Ranks of the model: max(tp, ep) (one replica; under DP-attention each is also an attention rank)."""
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def dp_size(self) -> int:
        """Attention data-parallel ranks, each with its own scheduler and KV pool (1 without DP-attention)."""
        return self.world_size if self.enable_dp_attention else 1

    @property
    def graph_max_bs(self) -> int:
        """Largest captured decode batch: --cuda-graph-max-bs, else --max-running-requests (the old default, 64
        against 128 running requests, left batches of 65-128 eager: 155 of 574 eager steps in one bench), times
        1 + --speculative-num-steps when drafting: a verify step replays them as one token a row (not under
        DP-attention, whose verify steps run eagerly)."""
        drafting = self.speculative_algorithm is not None and not self.enable_dp_attention
        rows = 1 + (self.speculative_num_steps if drafting else 0)
        return self.cuda_graph_max_bs or self.max_running_requests * rows

    @property
    def piecewise_tokens(self) -> list[int]:
        """Token buckets of the piecewise CUDA graphs ([] when they are off)."""
        if self.disable_cuda_graph or self.disable_piecewise_cuda_graph:
            return []
        if self.piecewise_cuda_graph_tokens is not None:
            return parse_buckets(str(self.piecewise_cuda_graph_tokens), "--piecewise-cuda-graph-tokens")
        return piecewise_buckets(self.max_num_batched_tokens)

    def resolved_mixed_step_tokens(self) -> int:
        """--mixed-step-tokens, else the largest piecewise bucket on cuda without DP-attention (the only place
        piecewise graphs run), else 0: no cap."""
        if self.mixed_step_tokens is not None:
            return self.mixed_step_tokens
        if self.enable_dp_attention or not self.piecewise_tokens or self.resolved_device() != "cuda":
            return 0
        return max(self.piecewise_tokens)

    @property
    def chunk_size(self) -> int:
        return self.chunked_prefill_size or self.max_num_batched_tokens

    @property
    def overlap_schedule(self) -> bool:
        """Whether the engine core overlaps scheduling with the device (engine/overlap.py): as asked, else on
        cuda only."""
        if self.disable_overlap_schedule is not None:
            return not self.disable_overlap_schedule
        return self.resolved_device() == "cuda" and self.speculative_algorithm is None

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        if no_gpu_present():  # a CPU-only machine: known without torch's import (seconds in the HTTP process)
            return "cpu"
        import torch  # only here: keeps the class importable without torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        """`auto`: bfloat16 on a GPU (the checkpoints' non-FP8 dtype), float32 on the CPU reference path."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device() == "cuda" else "float32"

    def check_device(self) -> None:
        """--device cuda where torch finds none: refused with the flag before any process or tensor is made.
        torch is asked where it is imported already (the ModelRunner), or where the machine shows no GPU device
        (then the import costs nothing that matters: a start that fails; WSL2's GPU is not a /dev/nvidia node).
        A healthy GPU start in a process without torch stays without it."""
        if self.device != "cuda":
            return
        torch = sys.modules.get("torch")
        if torch is None and no_gpu_present():
            import torch
        if torch is not None and not torch.cuda.is_available():
            raise ValueError(f"--device: cuda, but torch {torch.__version__} finds no CUDA device "
                             "(use --device cpu)")

    def check_layout(self, cfg: Any) -> None:
        """The parallel layout against the model (heads, experts, 128-blocks) and --max-model-len against its
        positions, before any weight is read; and, on cuda, the ranks of this node against the visible GPUs.
        ValueError naming field and numbers."""
        from dsaserve.distributed.layout import check_layout

        device = self.resolved_device()
        max_len = cfg.max_position_embeddings
        if self.max_model_len is not None and self.max_model_len > max_len:
            raise ValueError(f"--max-model-len: {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {max_len}")
        check_layout(cfg, self.tensor_parallel_size, self.expert_parallel_size, self.enable_dp_attention,
                     keep_fp8=device == "cuda")
        if device == "cpu":
            self._check_host_memory(cfg)
        if device == "cuda" and self.world_size > 1:
            import torch

            visible = torch.cuda.device_count()
            if self.ranks_per_node > visible:
                raise ValueError(f"--tensor-parallel-size/--expert-parallel-size: {self.ranks_per_node} ranks on "
                                 f"this node, but only {visible} GPUs are visible")

    def _check_host_memory(self, cfg: Any) -> None:
        """The CPU path holds every weight in the compute dtype: a model whose weights alone pass this machine's
        memory is refused at once (the full GLM-5.3 in float32 would need ~3 TB; it used to grow until killed)."""
        from dsaserve.weights.spec import checkpoint_specs

        mtp = () if self.loads_mtp else tuple(f"model.layers.{i}." for i in cfg.mtp_layer_ids)  # built only if asked
        params = sum(math.prod(t.shape) for t in checkpoint_specs(cfg)
                     if not t.name.endswith("_scale_inv") and not (mtp and t.name.startswith(mtp)))
        need = params * (4 if self.resolved_dtype() == "float32" else 2) / self.nnodes
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > have:
            raise ValueError(f"--model {self.model}: its {params / 1e9:.1f} B weights need {need / 1e9:.0f} GB of "
                             f"host memory as {self.resolved_dtype()} on the CPU, this machine has "
                             f"{have / 1e9:.0f} GB (--device cuda, or a smaller model such as glm-5.3-mini)")

    # ---- command line --------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        """Add one `--flag` per field (bools as --x / --no-x); `skip` leaves fields to the caller."""
        for f in fields(cls):
            if f.name in skip:
                continue
            default = f.default if f.default is not MISSING else None
            kw: dict[str, Any] = {"default": default, "help": f.metadata["help"], "dest": f.name}
            names = (flag(f.name), *f.metadata.get("aliases", ()))
            if isinstance(default, bool) or f.metadata.get("bool_flag"):  # bool_flag: a bool whose default is None
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = f.metadata.get("type") or (str if f.name in _STR_FIELDS else int)
                if f.metadata.get("choices"):
                    kw["choices"] = f.metadata["choices"]
            parser.add_argument(*names, **kw)

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
