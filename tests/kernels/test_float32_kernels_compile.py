"""The kernels a float32 model's GPU path runs (`dsaserve eval`'s GPU-in-float32 comparison) compile for sm_90 with
float32 products, and their bf16 specialisations keep their bf16 tensor-core MMAs: compiled offline on the CPU
(tests/offline_triton.py), because the branch on the operands' dtype is decided at compile time, which Triton's
interpreter (its kernels are plain Python) never checks. Each wrapper runs as on a GPU; a launch only compiles
(`JITFunction.warmup`)."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


from dsaserve.common.kv_layout import encode_latent  # noqa: E402
from dsaserve.kernels import triton_fp8_gemm, triton_head_gemm, triton_moe, triton_sparse_mla  # noqa: E402
from dsaserve.weights.fp8 import quantize_fp8_block  # noqa: E402
from tests.offline_triton import offline_jit  # noqa: E402

# the kernels whose products are checked; every kernel the calls launch gets a private in-memory cache (a kernel
# compiled offline has no module: a later launch on a GPU must not find it)
CHECKED = (triton_fp8_gemm._fp8_gemm_kernel, triton_fp8_gemm._fp8_skinny_kernel, triton_sparse_mla._sparse_mla_kernel,
           triton_moe._moe_gemm_kernel, triton_moe._moe_skinny_kernel, triton_moe._moe_unsorted_kernel,
           triton_head_gemm._head_gemm_kernel)
KERNELS = (*CHECKED, triton_moe._combine_k_kernel)
LOW_PRECISION_MMA = re.compile(r"\bw?mma\S*\.(bf16|f16|tf32)\b")


def _compile_all() -> None:
    """The float32 and bf16 calls of each kernel, at glm-5.3-mini's shapes (the float32 comparisons' model)."""
    w, s = quantize_fp8_block(torch.randn(256, 384))
    e, h, inter, k = 8, 256, 128, 2
    w13, s13 = quantize_fp8_block(torch.randn(e, 2 * inter, h))
    w2, s2 = quantize_fp8_block(torch.randn(e, h, inter))
    cache = encode_latent(torch.randn(300, 256 + 32), "fp8_ds_mla", 256)
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 40, 300):  # the skinny kernel's FMA and MMA tiles, the tiled GEMM
            triton_fp8_gemm.fp8_linear(torch.zeros(m, 384, dtype=dtype), w, s, exact_act=True)
        q = (torch.zeros(3, 6, 256, dtype=dtype), torch.zeros(3, 6, 32, dtype=dtype))
        triton_sparse_mla.sparse_mla_attention(*q, cache, "fp8_ds_mla", torch.zeros(3, 64, dtype=torch.int64),
                                               0.04, 256)
        for t, kernel in ((1, None), (9, None), (300, None), (300, "gemm")):  # unsorted, skinny, the tiled GEMM
            ids = torch.stack([torch.zeros(t, dtype=torch.int64), torch.ones(t, dtype=torch.int64)], 1)
            triton_moe.fused_moe(torch.zeros(t, h, dtype=dtype), w13, s13, w2, s2, torch.full((t, k), 0.5), ids,
                                 config={"fp8_act": False, **({"kernel": kernel} if kernel else {})})
        triton_head_gemm.head_bmm(torch.zeros(3, 6, 64, dtype=dtype), torch.zeros(6, 64, 256, dtype=dtype))


def _variants(cache: Path) -> dict[tuple[str, str], list[str]]:
    """(kernel, its first operand's element type) -> the PTX of each compiled variant."""
    out: dict[tuple[str, str], list[str]] = defaultdict(list)
    for ttir in cache.rglob("*.ttir"):
        first = re.search(r"tt\.func public @\w+\(%\w+: !tt\.ptr<(\w+)>", ttir.read_text())
        out[ttir.stem, first.group(1)].append(ttir.with_suffix(".ptx").read_text())
    return out


def test_the_float32_path_compiles_without_bf16_or_tf32_products(monkeypatch, tmp_path):
    offline_jit(monkeypatch, tmp_path / "triton", KERNELS, launches=True)
    for module in (triton_fp8_gemm, triton_sparse_mla, triton_moe, triton_head_gemm):
        if hasattr(module, "_sm_count"):
            monkeypatch.setattr(module, "_sm_count", lambda *a: 132)
    _compile_all()
    variants = _variants(tmp_path / "triton")
    for fn in CHECKED:
        f32, bf16 = variants[fn.__name__, "f32"], variants[fn.__name__, "bf16"]
        assert f32 and bf16, (fn.__name__, sorted(variants))
        assert not any(LOW_PRECISION_MMA.search(p) for p in f32), f"{fn.__name__}: a float32 variant rounds"
        assert any(LOW_PRECISION_MMA.search(p) for p in bf16), f"{fn.__name__}: no bf16 variant on tensor cores"
