"""Kernel registry: one implementation per hot op, chosen once per device at startup.

(Minimal version by the lead so the model runs; the GPU-kernels engineer extends it with the Triton
variants. Contract: `get_ops(device)` returns a namespace whose attributes are named exactly as the
functions of `kernels/reference.py`.)
"""

from __future__ import annotations

import types

import torch

from dsaserve.kernels import reference

_OPS = ("fp8_linear", "rms_norm", "apply_rope", "mla_kv_write", "indexer_topk", "sparse_mla_attention",
        "moe_route", "fused_moe")
_CACHE: dict[str, types.SimpleNamespace] = {}


def get_ops(device: torch.device | str) -> types.SimpleNamespace:
    key = torch.device(device).type
    if key not in _CACHE:
        _CACHE[key] = types.SimpleNamespace(**{name: getattr(reference, name) for name in _OPS})
    return _CACHE[key]
