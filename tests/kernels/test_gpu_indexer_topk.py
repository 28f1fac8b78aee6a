"""GPU DSA indexer selection paths against their references: the long-row decode selection
(`kernels/triton_indexer_long.py`) and the prefill GEMM + streaming top-k (`kernels/triton_indexer_prefill.py`).
Set-up and error bounds: tests/kernels/gpu_common.py. Small shapes run under the Triton interpreter; the
model's (GLM-5.3: 32 heads x 128, top-2048, rows up to 202752 keys) only on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_common import BIG, DEVICE, poison_free_memory, randn, requires_gpu_kernels
from tests.kernels.test_gpu_attention import _check_topk, _indexer_case, _position_ordered_topk

pytestmark = requires_gpu_kernels


def _rows(gen, kind, n, width):
    s = randn(n, width, gen=gen)
    return {"ties": lambda: (s * 3).round(), "all_equal": lambda: torch.full_like(s, 1.5),
            "negative": lambda: -s.abs() - 10, "narrow": lambda: 1.0 + s * 1e-6,
            "relu_zeros": lambda: s.clamp(min=0) * torch.sign(randn(n, width, gen=gen)),
            "sink_and_recent": lambda: s + 50 * (torch.arange(width, device=DEVICE) < 4) +
            torch.linspace(0, 3, width, device=DEVICE),
            "normal": lambda: s}[kind]()


# ---- long-row decode selection ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["normal", "ties", "all_equal", "negative", "narrow", "relu_zeros",
                                  "sink_and_recent"])
def test_long_row_select_takes_the_kth_key_exactly(gen, kind):
    """The multi-program radix select returns what the one-program kernel does: every key above the k-th,
    then ties in position order, as slots, in position order; rows shorter than k take all, -1 padded."""
    from dsaserve.kernels.triton_indexer_long import long_row_select

    n, width, k, chunk, ps = (6, 202752, 2048, 4096, 64) if BIG else (4, 1400, 64, 256, 16)
    s = _rows(gen, kind, n, width)
    pos = torch.randint(width // 3, width, (n,), generator=gen, device=DEVICE)
    pos[-1] = k // 2  # a token that sees fewer than k keys
    table = torch.randperm(n * (width // ps), generator=gen, device=DEVICE).view(n, -1)
    req = torch.arange(n, device=DEVICE)
    poison_free_memory()
    out = torch.full((n, k), -7, dtype=torch.int64, device=DEVICE)
    long_row_select(s, table, req, pos, out, k, ps, chunk=chunk)
    for r in range(n):
        p = int(pos[r])
        if p < k:
            j = torch.arange(p + 1, device=DEVICE)
            want = torch.cat([table[r, j // ps] * ps + j % ps, torch.full((k - p - 1,), -1, device=DEVICE)])
        else:
            j = _position_ordered_topk(s[r], p, k)
            want = table[r, j // ps] * ps + j % ps
        assert torch.equal(out[r], want), f"seed {gen.initial_seed()} row {r}"


@pytest.mark.skipif(not BIG, reason="the model's context bound: CUDA only")
def test_indexer_topk_long_context_decode_selects_the_reference_keys(gen):
    """The dispatcher takes the long-row path past 16K keys; the selection is the reference's (near-ties aside)."""
    idx = __import__("tests.kernels.gpu_common", fromlist=["gpu_modules"]).gpu_modules()[1]
    ps, hi, d, topk = 64, 32, 128, 2048
    seq_lens, ext = [40000, 3000, 70000], [1, 1, 1]
    q, w, cache, table, req, pos = _indexer_case(gen, "fp8_ds_mla", seq_lens, ext, ps, hi, d)
    assert table.shape[1] * ps > idx.ROW_IN_REGS_MAX
    got = idx.indexer_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps)
    _check_topk(got, q, w, cache, "fp8_ds_mla", table, req, pos, topk, ps, gen.initial_seed())
