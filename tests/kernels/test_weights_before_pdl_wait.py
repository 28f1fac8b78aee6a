"""Weights read before the PDL wait, as the GPU compiles it: offline for sm_90 on the CPU (tests/offline_triton.py).
RMSNorm's (`triton_elementwise.NORM_WEIGHT_FIRST`: the decoder's norms and the MLA KV write's), the router GEMV's rows
and moe_route's bias (`triton_moe_route.WEIGHTS_FIRST`). In a batch-1 step each is in the step's chain and its
weight comes from HBM; read after the wait, that read sat between the producer's end and the kernel's stores. The
interpreter has no PDL wait, so only the compiled order can show it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


from dsaserve.common.kv_layout import encode_latent  # noqa: E402
from dsaserve.kernels import triton_elementwise as E  # noqa: E402
from dsaserve.kernels import triton_kv_write as W  # noqa: E402
from dsaserve.kernels import triton_moe_route as M  # noqa: E402
from tests.offline_triton import offline_jit  # noqa: E402


def _compiled_ptx(monkeypatch, cache, kernel, weight_first: bool, launch) -> str:
    """The one PTX `launch()` compiles for `kernel` offline, with PDL on and both flags (NORM_WEIGHT_FIRST,
    WEIGHTS_FIRST) set to `weight_first`."""
    offline_jit(monkeypatch, cache, (kernel,), launches=True)
    for module in (E, W, M):
        monkeypatch.setattr(module, "pdl_args", lambda device: {"PDL": True})
    monkeypatch.setattr(E, "NORM_WEIGHT_FIRST", weight_first)
    monkeypatch.setattr(M, "WEIGHTS_FIRST", weight_first)
    launch()
    ptx = [p.read_text() for p in cache.rglob("*.ptx")]
    assert len(ptx) == 1
    assert ptx[0].count("griddepcontrol.wait") == 1
    return ptx[0]


def _first_global_access(ptx: str) -> str:
    """'wait' if griddepcontrol.wait comes before the kernel's first global load, else 'load'."""
    for line in ptx.splitlines():
        if "griddepcontrol.wait" in line:
            return "wait"
        if "ld.global" in line:
            return "load"
    raise AssertionError("no PDL wait and no global load in the PTX")


@pytest.mark.parametrize("weight_first", [True, False])
def test_the_weight_is_read_before_the_wait_and_the_rows_after(monkeypatch, tmp_path, weight_first):
    x = torch.zeros(1, 6144, dtype=torch.bfloat16)
    text = _compiled_ptx(monkeypatch, tmp_path, E._rms_norm_kernel, weight_first,
                         lambda: E.add_rms_norm(x, x.clone(), torch.ones(6144, dtype=torch.bfloat16), 1e-5))
    assert _first_global_access(text) == ("load" if weight_first else "wait")
    before = [line for line in text.split("griddepcontrol.wait")[0].splitlines() if "ld.global" in line]
    # the weight's block (8192 bf16, 6144 of them read) in 16-byte loads over 8 warps: 4 a thread; nothing else
    assert len(before) == (4 if weight_first else 0) and all(".v4.b32" in line for line in before), before


@pytest.mark.parametrize("weight_first", [True, False])
def test_the_mla_kv_write_reads_its_norm_weight_before_the_wait(monkeypatch, tmp_path, weight_first):
    dc, dr, heads = 512, 64, 64
    kv_a = torch.zeros(1, dc + dr, dtype=torch.bfloat16)
    cos = sin = torch.zeros(1, dr // 2, dtype=torch.bfloat16)
    cache = torch.zeros(4, encode_latent(kv_a.float(), "fp8_ds_mla", dc).shape[1], dtype=torch.uint8)
    q = torch.zeros(1, heads, 192 + dr, dtype=torch.bfloat16)
    text = _compiled_ptx(monkeypatch, tmp_path, W._mla_kv_write_kernel, weight_first, lambda: W.mla_kv_write(
        cache, "fp8_ds_mla", torch.zeros(1, dtype=torch.int64), kv_a, torch.ones(dc, dtype=torch.bfloat16), 1e-5,
        cos, sin, dc, q[..., 192:]))
    assert _first_global_access(text) == ("load" if weight_first else "wait")
    before = [line for line in text.split("griddepcontrol.wait")[0].splitlines() if "ld.global" in line]
    assert len(before) == (1 if weight_first else 0), before  # 512 bf16 over 4 warps: one 8-byte load a thread


@pytest.mark.parametrize("weight_first", [True, False])
def test_the_router_gemv_reads_its_weight_row_before_the_wait(monkeypatch, tmp_path, weight_first):
    x = torch.zeros(1, 6144, dtype=torch.bfloat16)
    text = _compiled_ptx(monkeypatch, tmp_path, M._router_logits_kernel, weight_first,
                         lambda: M.router_logits(x, torch.zeros(32, 6144)))
    assert _first_global_access(text) == ("load" if weight_first else "wait")
    before = [line for line in text.split("griddepcontrol.wait")[0].splitlines() if "ld.global" in line]
    # a row's block (8192 fp32, 6144 of them read) in 16-byte loads over 8 warps: 8 a thread; x's after the wait
    assert len(before) == (8 if weight_first else 0) and all(".v4.b32" in line for line in before), before


@pytest.mark.parametrize("weight_first", [True, False])
def test_moe_route_reads_its_bias_before_the_wait(monkeypatch, tmp_path, weight_first):
    logits = torch.zeros(1, 32)
    text = _compiled_ptx(monkeypatch, tmp_path, M._moe_route_kernel, weight_first,
                         lambda: M.moe_route(logits, torch.zeros(32), 8, 1, 1, 2.5, True))
    assert _first_global_access(text) == ("load" if weight_first else "wait")
