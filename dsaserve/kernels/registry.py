"""Kernel registry: picks one implementation per hot op, once, by device (startup chain: model load).

Owns: `get_ops(device)`, a namespace whose attributes are named exactly as the functions of
`kernels/reference.py` (plus `indexer_k_write`, and `graph_safe`: whether every op may be captured in a
CUDA graph), each bound to the GPU variant (`kernels/triton_*.py`)
when the device is CUDA, Triton imports and the GPU can run FP8 (compute capability >= 8.9), and to the
reference otherwise. `DSASERVE_KERNELS=reference` forces the reference everywhere (debugging, bisecting a
wrong answer); `DSASERVE_FP8_ACTIVATIONS=0` keeps the GPU FP8 GEMMs' activations bf16 (exact to bf16
rounding, ~1.4x slower decode GEMMs: for comparing with the CPU reference, bench/logit_distance.py). The namespace's
`impls` maps op -> implementation name, for the startup manifest. `interpreted_gpu_ops()` (tests) binds the GPU
variants on the CPU under the Triton interpreter, so a whole forward runs the GPU path without a GPU.
Triton is imported only here and only when it will be used: the CI's CPU torch wheel may not ship it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator
from types import SimpleNamespace

import torch

from dsaserve.common import envs
from dsaserve.kernels import reference

ENV_VAR = "DSASERVE_KERNELS"
CHOICES = ("auto", "reference")
# sparse MLA from 16 tokens on: the swap-AB tensor-core kernel (keys as the MMA's M) instead of the split-K one.
# Off until bench/sweep_sparse_mla_swap.py shows it faster on an H200 in every case (it prints FLIP yes / no).
SPARSE_MLA_SWAP_AB = False
FP8_ACT_ENV = "DSASERVE_FP8_ACTIVATIONS"  # "0": GPU FP8 GEMMs keep activations bf16 (exact, slower)
OPS = ("dequant_fp8_weight", "fp8_linear", "rms_norm", "add_rms_norm", "silu_and_mul", "apply_rope", "rope_inplace",
       "mla_kv_write", "indexer_k_write", "indexer_k_norm_write", "indexer_topk", "sparse_mla_attention", "moe_route",
       "fused_moe", "count_distinct", "head_bmm", "router_logits", "small_linear", "stage_latent", "remap_slots",
       "resolve_placeholders", "row_argmax", "copy_from_host", "stage_from_host", "embed_rope_rows")
_CACHE: dict[tuple[str, int | None, str, str], SimpleNamespace] = {}


def _reference_ops() -> dict[str, tuple[object, str]]:
    return {name: (getattr(reference, name), "reference") for name in OPS}


def gpu_kernels_usable(device: torch.device) -> tuple[bool, str]:
    """(usable, why not): CUDA device, Triton importable, FP8 conversions in hardware (sm_89+)."""
    if device.type != "cuda":
        return False, f"device {device.type}"
    if not torch.cuda.is_available():
        return False, "CUDA not available"
    if importlib.util.find_spec("triton") is None:
        return False, "triton not installed"
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        return False, f"compute capability {cap[0]}.{cap[1]} < 8.9 (no FP8)"
    return True, ""


def _gpu_ops(device: torch.device) -> dict[str, tuple[object, str]]:
    from dsaserve.kernels.jit_keys import install_compile_hook

    install_compile_hook()  # before any launch: the disk-cache entries the precompile and the preload name
    from dsaserve.kernels import (
        gluon_fp8_splitk,
        gluon_sparse_mla,
        triton_argmax,
        triton_elementwise,
        triton_fp8_gemm,
        triton_head_gemm,
        triton_indexer,
        triton_indexer_coop,
        triton_indexer_dispatch,
        triton_kv_stage,
        triton_kv_write,
        triton_moe,
        triton_moe_route,
        triton_sparse_mla_swap,
    )

    gemm = f"triton skinny GEMM (M<={triton_fp8_gemm.SMALL_M}) + torch._scaled_mm block-scaled, FP8 activations"
    if triton_fp8_gemm.SPLITK_GEMM:
        lo, hi = triton_fp8_gemm.SPLITK_ROWS
        gemm += f"; gluon warp-specialised split-K GEMM where K splits (M {lo}-{hi}, K>={triton_fp8_gemm.SPLITK_MIN_K})"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        gemm = "triton block-scaled GEMM, FP8 activations"
    moe = "triton grouped GEMM (sort-free <= 256 pairs, else align; gate/up+SiLU, down) + combine, FP8 activations"
    linear, fused_moe = triton_fp8_gemm.fp8_linear, triton_moe.fused_moe
    flag = envs.DSASERVE_FP8_ACTIVATIONS
    if flag not in ("0", "1"):
        raise ValueError(f"{FP8_ACT_ENV}={flag!r}: expected 0 or 1")
    if flag == "0":
        linear = functools.partial(triton_fp8_gemm.fp8_linear, exact_act=True)
        fused_moe = functools.partial(triton_moe.fused_moe, config={"fp8_act": False})
        gemm, moe = gemm.replace("FP8 activations", "bf16 activations"), moe.replace("FP8", "bf16")
    elif device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        moe += "; large prefills: a block-scaled cuBLAS GEMM an expert (kernels/cublas_moe_prefill.py)"
    argmax = envs.DSASERVE_ROW_ARGMAX == "triton"  # opt-in: launched eagerly it loses to torch's (envs.py)
    if device.type == "cuda":  # the split kernels' counters, the selection's workspace: never first inside a capture
        triton_fp8_gemm.split_counters(device)
        if gluon_fp8_splitk.available(device):
            gluon_fp8_splitk.counters(device)
        triton_indexer_coop.coop_workspace(device)
        if argmax:
            triton_argmax.workspace(device)
    gemv_t, tile_t = triton_moe_route.ROUTER_GEMV_MAX_T, triton_moe_route.TILE_GEMM_MAX_T
    ops = _reference_ops()
    ops.update({
        "fp8_linear": (linear, gemm),
        "fused_moe": (fused_moe, moe),
        "moe_route": (triton_moe_route.moe_route, "triton fused sigmoid + group-limited top-k + normalise"),
        "count_distinct": (triton_moe_route.count_distinct, "triton one-program count"),
        "router_logits": (triton_moe_route.router_logits, f"triton fp32 GEMV (T<={gemv_t}), split-K tiles of "
                          f"exact bf16 products (T<={tile_t}, bf16-valued weight), else cuBLAS"),
        "small_linear": (triton_moe_route.small_linear,
                         f"triton fp32 GEMV (T<={gemv_t}), split-K tiles (T<={tile_t}), else cuBLAS"),
        "rms_norm": (triton_elementwise.rms_norm, "triton row kernel"),
        "add_rms_norm": (triton_elementwise.add_rms_norm, "triton residual add + RMSNorm"),
        "silu_and_mul": (triton_elementwise.silu_and_mul, "triton SiLU(gate) * up"),
        "rope_inplace": (triton_elementwise.rope_inplace, "triton in-place RoPE"),
        "resolve_placeholders": (triton_elementwise.resolve_placeholders, "triton one-launch placeholder ids"),
        "embed_rope_rows": (triton_elementwise.embed_rope_rows, "triton embedding + RoPE rows, one launch"),
        "copy_from_host": (triton_elementwise.copy_from_host,
                           f"triton read of pinned memory (<= {triton_elementwise.HOST_READ_MAX_BYTES} B), "
                           "else a copy"),
        "stage_from_host": (triton_elementwise.stage_from_host, "triton read of pinned memory: the rows, then only "
                            "the page table's changes"),
        "row_argmax": (triton_argmax.row_argmax, "triton split-row argmax, one launch") if argmax else
        (ops["row_argmax"][0], "torch argmax (DSASERVE_ROW_ARGMAX=triton: the split-row kernel)"),
        "head_bmm": (triton_head_gemm.head_bmm,
                     f"triton per-head GEMM + FP8 copy (T<={triton_fp8_gemm.SMALL_M}), else cuBLAS bmm"),
        "indexer_topk": (triton_indexer_dispatch.indexer_topk, _indexer_impl(triton_indexer, flag)),
        "sparse_mla_attention": _sparse_mla(gluon_sparse_mla, triton_sparse_mla_swap),
        "mla_kv_write": (triton_kv_write.mla_kv_write, "triton fused RMSNorm+RoPE+encode+scatter"),
        "indexer_k_write": (triton_kv_write.indexer_k_write, "triton FP8 encode+scatter"),
        "indexer_k_norm_write": (triton_kv_write.indexer_k_norm_write, "triton fused LayerNorm+RoPE+encode+scatter"),
        "stage_latent": (triton_kv_stage.stage_latent, "triton fp8_ds_mla -> bf16 rows of a prefill's pages"),
        "remap_slots": (triton_kv_stage.remap_slots, "triton page-map gather"),
    })
    return ops


def _sparse_mla(gluon, swap) -> tuple[object, str]:
    """Sparse MLA's kernel: the Gluon kernels' dispatcher (Gluon where it takes the call, else the Triton kernels),
    or under SPARSE_MLA_SWAP_AB the swap-AB kernel from `swap.SWAP_MIN_TOKENS` tokens on (split-K below)."""
    if SPARSE_MLA_SWAP_AB:
        return swap.sparse_mla_attention, (f"triton swap-AB tensor cores (T>={swap.SWAP_MIN_TOKENS}), else sparse "
                                           "flash-decoding")
    return gluon.sparse_mla_attention, (f"gluon wgmma from {gluon.GLUON_MIN_TOKENS} tokens on sm_90 (bf16 / "
                                        f"fp8_ds_mla at kv_lora 512; bf16 rows unsplit from {gluon.WS_MIN_TOKENS}: "
                                        "warp-specialised), else triton sparse flash-decoding")


def _indexer_impl(triton_indexer, fp8_flag: str) -> str:
    """What the indexer runs, by batch shape and static row length (`triton_indexer_dispatch`)."""
    q = "FP8" if fp8_flag != "0" else "fp16"
    return (f"decode (<={triton_indexer.SELECT_MAX_ROWS} tokens): triton paged FP8 scores + triton select, one program "
            f"per row up to {triton_indexer.ROW_IN_REGS_MAX} keys, radix split over programs past it; prefill: "
            f"triton {q}-q tiled score GEMM into a chunk workspace + select (FP8 keys; DSASERVE_INDEXER_PREFILL="
            f"stream: GEMM + streaming top-k), torch.topk (bf16/fp32 keys)")


def get_ops(device: torch.device | str) -> SimpleNamespace:
    """The op namespace for `device` (cached). `ops.impls[name]` says which implementation each op got."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    choice = envs.DSASERVE_KERNELS
    if choice not in CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(CHOICES)}")
    key = _cache_key(device)
    if key not in _CACHE:
        usable, why = gpu_kernels_usable(device)
        if choice == "reference":
            usable, why = False, f"{ENV_VAR}=reference"
        ops = _gpu_ops(device) if usable else _reference_ops()
        # graph_safe: no host sync and static shapes in every op (the reference fused_moe / indexer_topk
        # loop on the host), so the decode forward can be captured into CUDA graphs
        _CACHE[key] = SimpleNamespace(**{name: fn for name, (fn, _) in ops.items()},
                                      impls={name: impl for name, (_, impl) in ops.items()},
                                      device=str(device), fallback_reason=why, graph_safe=usable)
    return _CACHE[key]


def _cache_key(device: torch.device) -> tuple:
    """What an op namespace depends on: the device and every switch that picks an implementation."""
    return device.type, device.index, envs.DSASERVE_KERNELS, envs.DSASERVE_FP8_ACTIVATIONS, envs.DSASERVE_ROW_ARGMAX


@contextlib.contextmanager
def interpreted_gpu_ops() -> Iterator[SimpleNamespace]:
    """Test hook: for the block, the CPU's ops are the GPU variants, run by the Triton interpreter (TRITON_INTERPRET=1
    before Triton is imported), so the whole model's GPU path runs on a machine without a GPU. Not graph_safe:
    no CUDA graphs and no side stream on the CPU. The FP8-activation switch is read on entry."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("interpreted_gpu_ops: needs TRITON_INTERPRET=1 (set before Triton is imported)")
    device = torch.device("cpu")
    key = _cache_key(device)
    ops, before = _gpu_ops(device), _CACHE.pop(key, None)
    _CACHE[key] = SimpleNamespace(**{name: fn for name, (fn, _) in ops.items()},
                                  impls={name: impl if impl == "reference" else f"{impl} (interpreted)"
                                         for name, (_, impl) in ops.items()},
                                  device=str(device), fallback_reason="", graph_safe=False)
    try:
        yield _CACHE[key]
    finally:
        _CACHE.pop(key)
        if before is not None:
            _CACHE[key] = before


def describe(device: torch.device | str) -> dict[str, str]:
    """op -> implementation, plus why the reference was chosen (startup manifest)."""
    ops = get_ops(device)
    out = dict(ops.impls)
    if ops.fallback_reason:
        out["_fallback_reason"] = ops.fallback_reason
    return out
