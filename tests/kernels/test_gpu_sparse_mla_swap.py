"""Swap-AB sparse MLA (kernels/triton_sparse_mla_swap.py) against `reference.sparse_mla_attention`: every KV layout,
the config knobs, -1 slots, latents off the powers of two, a token with no slots, 64-bit row offsets, and the
dispatcher the registry binds under SPARSE_MLA_SWAP_AB. GLM-5.3's shapes on the GPU, small ones under the Triton
interpreter. Set-up and error bounds: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import encode_latent
from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import (
    BF16,
    BIG,
    DEVICE,
    check_sparse_mla,
    check_sparse_mla_token_without_slots,
    far_rows_case,
    randn,
    rel,
    requires_gpu_kernels,
    sparse_mla_case,
)

pytestmark = requires_gpu_kernels
LAYOUTS = ["fp8_ds_mla", "bf16", "fp8_e4m3", "fp32"]
# (heads, kv_lora_rank, rope, top-k, cache rows): GLM-5.3 on the GPU; a small model under the interpreter (the
# top-k spans two 32-key tiles, so the online softmax runs over more than one tile)
GLM = (64, 512, 64, 2048, 8192) if BIG else (4, 128, 16, 50, 200)
SMALL_TILES = {} if BIG else {"block_k": 32, "num_warps": 4}  # the interpreter's cost grows with the tile


def _check(gen, args, layout, dc, config=None):
    from dsaserve.kernels.triton_sparse_mla_swap import sparse_mla_attention_swap

    check_sparse_mla(sparse_mla_attention_swap, gen, args, layout, dc, {**SMALL_TILES, **(config or {})})


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("splits", [1, 2])
def test_swap_kernel_matches_reference_on_every_layout(gen, layout, splits):
    """Unsplit and split top-k (combine kernel); a third of token 0's selection is -1."""
    k = GLM[3]
    args = sparse_mla_case(gen, 20 if BIG else 2, GLM, layout, (slice(0, 1), slice(k // 3, k // 2)))
    _check(gen, args, layout, GLM[1], {"splits": splits})


@pytest.mark.parametrize("config", [{"reload": False}, {"lazy": True}, {"num_stages": 2}, {"block_h": 16},
                                    {"reload": False, "lazy": True}])
def test_swap_kernel_configs_match_reference(gen, config):
    _check(gen, sparse_mla_case(gen, 20 if BIG else 2, GLM, "fp8_ds_mla"), "fp8_ds_mla", GLM[1], config)


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16"])
def test_swap_kernel_handles_head_and_latent_dims_off_the_powers_of_two(gen, layout):
    """80 heads (two head blocks, the second partly masked), kv_lora 384 (the last group masked), rope 48."""
    dims = (80, 384, 48, 256, 1024) if BIG else (20, 384, 48, 24, 64)
    args = sparse_mla_case(gen, 17 if BIG else 1, dims, layout)
    _check(gen, args, layout, dims[1], {"block_h": 16} if not BIG else None)


def test_swap_kernel_gives_zeros_for_a_token_with_no_slots(gen):
    from dsaserve.kernels.triton_sparse_mla_swap import sparse_mla_attention_swap

    check_sparse_mla_token_without_slots(sparse_mla_attention_swap, gen, GLM, SMALL_TILES)


def test_swap_kernel_reads_head_major_queries_and_writes_into_out(gen):
    """q_nope as cuBLAS's bmm leaves it ([H, T, dc] transposed: head stride T * dc), the result into `out`."""
    from dsaserve.kernels.triton_sparse_mla_swap import sparse_mla_attention_swap

    h, dc, dr, k, n = GLM
    t = 5
    qn = randn(h, t, dc, gen=gen, dtype=torch.bfloat16).transpose(0, 1)
    _, qr, cache, slots = sparse_mla_case(gen, t, GLM, "fp8_ds_mla")
    out = torch.full((t, h, dc), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = sparse_mla_attention_swap(qn, qr, cache, "fp8_ds_mla", slots, 0.04, dc, out=out, config=SMALL_TILES)
    assert got is out
    assert rel(out, R.sparse_mla_attention(qn, qr, cache, "fp8_ds_mla", slots, 0.04, dc)) < BF16


@pytest.mark.skipif(not BIG, reason="a 2.2 GB cache: GPU only")
def test_swap_kernel_reads_rows_past_two_gigabytes(gen):
    """Slots x 656 B pass 2^31 (202K context x many pages): the row offsets must be 64-bit."""
    args, dc = far_rows_case(gen)
    _check(gen, args, "fp8_ds_mla", dc)


def test_dispatcher_takes_the_swap_kernel_from_16_tokens_on_latents_it_supports(monkeypatch):
    """Below SWAP_MIN_TOKENS, and for a latent outside 64..512, the split-K flash-decoding kernel."""
    from dsaserve.kernels import triton_sparse_mla
    from dsaserve.kernels import triton_sparse_mla_swap as S

    calls = []
    monkeypatch.setattr(S, "sparse_mla_attention_swap", lambda *a, **k: calls.append("swap"))
    monkeypatch.setattr(triton_sparse_mla, "sparse_mla_attention", lambda *a, **k: calls.append("split-k"))
    for t, dc in ((1, 512), (S.SWAP_MIN_TOKENS - 1, 512), (S.SWAP_MIN_TOKENS, 512), (4096, 512), (4096, 1024)):
        S.sparse_mla_attention(torch.zeros(t, 4, dc), None, None, "bf16", None, 0.1, dc)
    assert calls == ["split-k", "split-k", "swap", "swap", "split-k"]


def test_split_count_fills_one_wave_without_a_second():
    from dsaserve.kernels.triton_sparse_mla_swap import pick_splits

    assert pick_splits(16, 2048, 128, 132) == 8  # decode T=16: 128 programs
    assert pick_splits(32, 2048, 128, 132) == 4
    assert pick_splits(128, 2048, 128, 132) == 1  # 128 programs already fill the 132 SMs once
    assert pick_splits(1, 2048, 128, 132) == 8  # capped: every split keeps two 128-key tiles


def test_registry_binds_the_dispatcher_only_when_switched_on(monkeypatch):
    """Off (the default): the Gluon kernels' dispatcher, which falls back to the Triton kernels itself."""
    from dsaserve.kernels import gluon_sparse_mla, registry, triton_sparse_mla_swap

    for on, want in ((False, gluon_sparse_mla.sparse_mla_attention),
                     (True, triton_sparse_mla_swap.sparse_mla_attention)):
        monkeypatch.setattr(registry, "SPARSE_MLA_SWAP_AB", on)
        fn, impl = registry._gpu_ops(torch.device("cpu"))["sparse_mla_attention"]
        assert fn is want and ("swap-AB" in impl) == on


@pytest.mark.skipif(not BIG, reason="17 GB of queries and output: GPU only")
def test_swap_kernel_takes_a_131072_token_prefill_with_head_major_queries(gen):
    """bench_gpu --prefill 131072's layout: head h's q offset is h * 2^26, past 2^31 from head 32 on."""
    from dsaserve.kernels.triton_sparse_mla_swap import sparse_mla_attention_swap

    t, h, dc, dr, k, n_slots = 131072, 64, 512, 64, 64, 4096
    q_nope = torch.empty(h, t, dc, dtype=torch.bfloat16, device=DEVICE).normal_(generator=gen).transpose(0, 1)
    q_rope = randn(t, h, dr, gen=gen, dtype=torch.bfloat16)
    cache = encode_latent(randn(n_slots, dc + dr, gen=gen), "fp8_ds_mla", dc)
    slots = torch.randint(0, n_slots, (t, k), generator=gen, device=DEVICE)
    got = sparse_mla_attention_swap(q_nope, q_rope, cache, "fp8_ds_mla", slots, 0.04, dc)
    rows = torch.tensor([0, 1, t // 2, t - 2, t - 1], device=DEVICE)
    ref = R.sparse_mla_attention(q_nope[rows], q_rope[rows], cache, "fp8_ds_mla", slots[rows], 0.04, dc)
    assert rel(got[rows], ref) < BF16, f"seed {gen.initial_seed()}"
