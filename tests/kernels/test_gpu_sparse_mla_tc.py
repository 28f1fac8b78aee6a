"""Tensor-core sparse MLA (kernels/triton_sparse_mla_tc.py) against `reference.sparse_mla_attention`: every KV
layout at GLM-5.3's shapes on the GPU (small shapes under the Triton interpreter), the config knobs, the bit-level
FP8 decode, 64-bit row offsets and the registry's dispatch by token count.
Set-up and error bounds: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_common import (
    BIG,
    DEVICE,
    HAS_TRITON,
    check_sparse_mla,
    check_sparse_mla_token_without_slots,
    far_rows_case,
    requires_gpu_kernels,
    sparse_mla_case,
)

pytestmark = requires_gpu_kernels
LAYOUTS = ["fp8_ds_mla", "bf16", "fp8_e4m3", "fp32"]
# (heads, kv_lora_rank, rope, top-k, cache rows): GLM-5.3 on the GPU; a small model under the interpreter
GLM = (64, 512, 64, 2048, 8192) if BIG else (4, 128, 16, 40, 200)


def _check(gen, args, layout, dc, config=None):
    from dsaserve.kernels.triton_sparse_mla_tc import sparse_mla_attention_tc

    check_sparse_mla(sparse_mla_attention_tc, gen, args, layout, dc, config)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("t", [20, 300] if BIG else [3])
def test_tc_kernel_matches_reference_on_every_layout(gen, layout, t):
    """T=20 splits the top-k over programs (combine kernel), T=300 runs unsplit; a third of a selection is -1."""
    k = GLM[3]
    _check(gen, sparse_mla_case(gen, t, GLM, layout, (slice(0, 1), slice(k // 3, k // 2))), layout, GLM[1])


@pytest.mark.parametrize("config", [{"num_warps": 8, "dv_split": 1, "block_k": 64}, {"bits": False},
                                    {"prefetch": False, "num_stages": 2}, {"num_warps": 8}, {"block_k": 16},
                                    {"splits": 3}])
def test_tc_kernel_configs_match_reference(gen, config):
    _check(gen, sparse_mla_case(gen, 20 if BIG else 2, GLM, "fp8_ds_mla"), "fp8_ds_mla", GLM[1], config)


@pytest.mark.parametrize("layout", ["fp8_ds_mla", "bf16"])
def test_tc_kernel_handles_head_and_latent_dims_off_the_powers_of_two(gen, layout):
    """80 heads (two head blocks, the second partly masked), kv_lora 384 (half b masked), rope 48."""
    dims = (80, 384, 48, 256, 1024) if BIG else (20, 384, 48, 24, 64)
    _check(gen, sparse_mla_case(gen, 17 if BIG else 2, dims, layout), layout, dims[1])


@pytest.mark.parametrize("splits", [1, 2])
def test_tc_kernel_launches_many_tokens_in_chunks_of_the_grid_limit(gen, monkeypatch, splits):
    """More tokens than CUDA's grid axis allows (65535, here lowered to 2): one launch per chunk of tokens."""
    from dsaserve.kernels import triton_sparse_mla_tc

    monkeypatch.setattr(triton_sparse_mla_tc, "MAX_GRID_Y", 2)
    _check(gen, sparse_mla_case(gen, 5, GLM, "fp8_ds_mla"), "fp8_ds_mla", GLM[1], {"splits": splits})


def test_tc_kernel_gives_zeros_for_a_token_with_no_slots(gen):
    from dsaserve.kernels.triton_sparse_mla_tc import sparse_mla_attention_tc

    check_sparse_mla_token_without_slots(sparse_mla_attention_tc, gen, GLM)


@pytest.mark.skipif(not BIG, reason="a 2.2 GB cache: GPU only")
def test_tc_kernel_reads_rows_past_two_gigabytes(gen):
    """Slots x 656 B pass 2^31 (202K context x many pages): the row offsets must be 64-bit."""
    args, dc = far_rows_case(gen)
    _check(gen, args, "fp8_ds_mla", dc)


if HAS_TRITON:  # a one-op kernel around the decode (the CPU CI's torch wheel may ship no Triton)
    import triton
    import triton.language as tl

    from dsaserve.kernels.triton_sparse_mla_tc import e4m3_bf16

    @triton.jit
    def _decode_kernel(x_ptr, y_ptr):
        offs = tl.arange(0, 256)
        tl.store(y_ptr + offs, e4m3_bf16(tl.load(x_ptr + offs), True))


def test_bit_level_e4m3_decode_is_exact_for_every_byte():
    """`e4m3_bf16` with BITS: each finite e4m3 byte -> bf16 equal to its value times 2^-120, bit for bit
    (subnormals and both zeros included); on the GPU this runs the inline-asm path."""
    x = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    y = torch.empty(256, dtype=torch.bfloat16, device=DEVICE)
    _decode_kernel[(1,)](x, y)
    finite = (x & 0x7F) != 0x7F
    want = (x.view(torch.float8_e4m3fn).float() * 2.0 ** -120).bfloat16()
    assert torch.equal(y[finite].view(torch.int16).cpu(), want[finite].view(torch.int16).cpu())


def test_registry_op_takes_the_tc_kernel_from_16_tokens(monkeypatch):
    """Below TC_MIN_TOKENS the split-K flash-decoding kernel, from it on the tensor-core one."""
    from dsaserve.kernels import triton_sparse_mla, triton_sparse_mla_tc

    calls = []
    monkeypatch.setattr(triton_sparse_mla_tc, "sparse_mla_attention_tc", lambda *a, **k: calls.append("tc"))
    monkeypatch.setattr(triton_sparse_mla, "sparse_mla_attention", lambda *a, **k: calls.append("split-k"))
    for t in (1, triton_sparse_mla_tc.TC_MIN_TOKENS - 1, triton_sparse_mla_tc.TC_MIN_TOKENS, 4096):
        triton_sparse_mla_tc.sparse_mla_attention(torch.zeros(t, 4, 128), None, None, "bf16", None, 0.1, 128)
    assert calls == ["split-k", "split-k", "tc", "tc"]


def test_split_count_fills_one_wave_of_resident_programs():
    from dsaserve.kernels.triton_sparse_mla_tc import pick_splits, programs_per_sm

    assert programs_per_sm({"num_warps": 4, "block_k": 32}) == 2
    assert programs_per_sm({"num_warps": 8, "block_k": 32}) == 1
    assert pick_splits(64, 2048, 32, 264) == 4  # decode T=32, two half-column programs a token: 256 programs
    assert pick_splits(256, 2048, 32, 264) == 1  # decode T=128 fills the wave without splitting
    assert pick_splits(2, 2048, 32, 264) == 32  # capped: every split keeps two 32-key tiles
