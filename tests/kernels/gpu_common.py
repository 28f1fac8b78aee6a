"""Shared set-up of the GPU kernel tests (`test_gpu_*.py`): each kernel (`kernels/triton_*.py`) against its
reference on the same random inputs.

Runs on a CUDA device (skipped cleanly without one). For development without a GPU, the Triton
interpreter runs them on the CPU: `TRITON_INTERPRET=1 DSASERVE_TEST_TRITON_INTERPRET=1 pytest ...`, with its
numerics patched to the GPU's where they differ (`_fix_the_interpreter`); bounds are doubled there all the same
(its fp32 sums run in numpy's order).
Every test draws a fresh seed (printed in the failure message). Outputs the op allocates are poisoned
by filling the caching allocator's free memory with NaN first, so an element the kernel never wrote
shows up as NaN. Relative errors are ||got - ref|| / ||ref||; the bounds, and where they come from:
  BF16: 1e-2   bf16 operands / outputs (8-bit mantissa, 2^-9 rounding) with fp32 accumulation
  FP8A: 6e-2   activations quantised per (token, 128) to e4m3 (3-bit mantissa: ~2.6% RMS on
               Gaussian data) where the reference keeps them exact (prefill GEMMs, prefill MoE)
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

from dsaserve.common import index_pages
from dsaserve.common.kv_layout import decode_index_k, encode_index_k, encode_latent
from dsaserve.config import ModelConfig, load_config
from dsaserve.kernels import reference as R

_INTERP = os.environ.get("DSASERVE_TEST_TRITON_INTERPRET") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
requires_gpu_kernels = pytest.mark.skipif(not HAS_TRITON or not (torch.cuda.is_available() or _INTERP),
                                          reason="GPU kernels need CUDA + Triton (or the Triton interpreter)")
SLACK = 2.0 if DEVICE == "cpu" else 1.0
BF16 = 1e-2 * SLACK
FP8A = 6e-2 * SLACK
# KV encode vs kv_pool's: same bytes but for rare rounding ties
ENC_REL, ENC_BYTES = 1e-2, 0.01
BIG = DEVICE == "cuda"


def _fix_the_interpreter() -> None:
    """Four differences of the Triton interpreter (seen in 3.9) from the GPU, patched for these tests:
    - a bf16 `tl.dot` hands np.matmul its operands' storage, raw uint16 bits: widen bf16 operands to fp32
      first (exact), as the GPU's bf16 MMA with fp32 accumulation does;
    - a comparison's result is tagged with its operands' dtype instead of int1, so a scalar comparison
      broadcast into a mask (`kmask & (m < M)`) becomes an int32 block that tl.load rejects as a mask;
    - fp32 -> bf16 truncates where the GPU rounds to nearest even: a bias toward zero at every rounding, which
      through glm-5.3-mini's 7 layers moved logits ~3x further from the reference than bf16 rounding does;
    - fp32 -> e4m3 rounds half up and carries a mantissa overflow into the exponent with an OR, not an add: a
      value just below 2^(2k+1) x 2 became 2^(2k+1) (half of it). KV rows written by the kernels then differed
      from kv_layout's (torch) encoding by ~5 %, where the GPU's cvt.rn.satfinite agrees but for ties.
    Each is replaced by torch's conversion (round to nearest even; e4m3 saturated at +-448 as satfinite does)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_dsaserve_fixed", False):
        return
    plain_dot, plain_binary = builder.create_dot, builder.binary_op

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interpreter.TensorHandle((x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return plain_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def binary_op(self, lhs, rhs, op):
        out = plain_binary(self, lhs, rhs, op)
        return interpreter.TensorHandle(out.data, tl.int1) if out.data.dtype == np.bool_ else out

    plain_cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:  # torch rounds to nearest even
            rounded = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(rounded.numpy().view(np.uint16), tl.bfloat16)
        return plain_cast(self, src, dst_type)

    plain_fp_to_fp = builder.create_fp_to_fp
    as_torch = {tl.float32: lambda d: torch.from_numpy(d), tl.float16: lambda d: torch.from_numpy(d),
                tl.bfloat16: lambda d: torch.from_numpy(d.view(np.int16)).view(torch.bfloat16)}

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar != tl.float8e4nv or src.dtype.scalar not in as_torch:
            return plain_fp_to_fp(self, src, dst_type, rounding_mode)
        x = as_torch[src.dtype.scalar](np.array(src.data)).float().clamp(-448.0, 448.0)
        return interpreter.TensorHandle(x.to(torch.float8_e4m3fn).view(torch.uint8).numpy(), tl.float8e4nv)

    builder.create_dot, builder.binary_op, builder.cast_impl = create_dot, binary_op, cast_impl
    builder.create_fp_to_fp, builder._dsaserve_fixed = create_fp_to_fp, True


if _INTERP and HAS_TRITON:
    _fix_the_interpreter()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def poison_free_memory() -> None:
    """Fill freed allocator blocks (large and small pools) with NaN so unwritten outputs are visible."""
    if DEVICE != "cuda":
        return
    big = torch.full((64 << 20,), float("nan"), device=DEVICE)
    small = [torch.full((1 << 16,), float("nan"), device=DEVICE) for _ in range(64)]
    del big, small


def randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def index_cache_of(keys: torch.Tensor, layout, page_size: int) -> torch.Tensor:
    """The page-major indexer cache holding keys [n, D] (encoded) at slots 0..n-1."""
    return index_pages.pack_pages(encode_index_k(keys, layout), layout, keys.shape[1], page_size)


def index_keys(cache: torch.Tensor, layout, d: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """The decoded keys [n, D] (float32) of `slots` (every slot when None) of a page-major indexer cache."""
    if slots is None:
        slots = torch.arange(cache.shape[0] * index_pages.page_size_of(cache, layout, d), device=cache.device)
    return decode_index_k(index_pages.read_rows(cache, slots, layout, d), layout)


def gpu_modules():
    from dsaserve.kernels import triton_fp8_gemm, triton_indexer, triton_kv_write, triton_moe, triton_sparse_mla

    return triton_fp8_gemm, triton_indexer, triton_kv_write, triton_moe, triton_sparse_mla


SMALL_ROWS = 32  # triton_fp8_gemm.SMALL_M: decode-size outputs carry an FP8 copy
BF16_ULP = dict(rtol=2 ** -6 * SLACK, atol=2 ** -6 * SLACK)  # one bf16 rounding apart (8-bit mantissa)


# The configs whose shapes every kernel must take (issue 18): GLM-5.3 itself (on a GPU: its sizes are slow in the
# interpreter), the shipped default glm-5.3-mini (kv_lora 256, rope 32, indexer 16 x 64, 8 experts, top-64), and
# the tiny test configs (kv_lora 128, rope 16, indexer 16 x 32; DeepSeek's 4 expert groups)
MODEL_NAMES = (["glm-5.3"] if BIG else []) + ["glm-5.3-mini", "glm-5.3-tiny", "deepseek-v3.2-tiny"]
MODELS: dict[str, ModelConfig] = {name: load_config(name) for name in MODEL_NAMES}


# ---- sparse MLA (test_gpu_sparse_mla_*.py: the tensor-core kernels, whose ops take a `config`) -----------------
def sparse_mla_case(gen, t: int, dims: tuple, layout: str, skip=(slice(0), slice(0))):
    """(q_nope, q_rope, cache, top-k slots) of T tokens; dims (heads, kv_lora_rank, rope, top-k, cache rows),
    slots drawn from every row, those at index `skip` -1."""
    h, dc, dr, k, n_slots = dims
    cache = encode_latent(randn(n_slots, dc + dr, gen=gen), layout, dc)
    slots = torch.randint(0, n_slots, (t, k), generator=gen, device=DEVICE)
    slots[skip] = -1
    qn, qr = randn(t, h, dc, gen=gen, dtype=torch.bfloat16), randn(t, h, dr, gen=gen, dtype=torch.bfloat16)
    return qn, qr, cache, slots


def check_sparse_mla(op, gen, args: tuple, layout: str, dc: int, config: dict | None = None) -> None:
    """`op` with `config` on a case's (q_nope, q_rope, cache, slots) against the reference, into poisoned memory."""
    poison_free_memory()
    got = op(*args[:3], layout, args[3], 0.04, dc, config=config)
    ref = R.sparse_mla_attention(*args[:3], layout, args[3], 0.04, dc)
    assert got.shape == ref.shape and got.dtype == ref.dtype and torch.isfinite(got).all()
    assert rel(got, ref) < BF16, f"seed {gen.initial_seed()} layout {layout} config {config}"


def check_sparse_mla_token_without_slots(op, gen, dims: tuple, config: dict | None = None) -> None:
    """Of three tokens, the middle one has every slot -1: `op` gives it zeros, the others the reference's output."""
    qn, qr, cache, slots = sparse_mla_case(gen, 3, dims, "fp8_ds_mla", (slice(1, 2), slice(None)))
    got = op(qn, qr, cache, "fp8_ds_mla", slots, 0.04, dims[1], config=config)
    assert got[1].eq(0).all()
    keep = torch.tensor([0, 2], device=DEVICE)
    ref = R.sparse_mla_attention(qn[keep], qr[keep], cache, "fp8_ds_mla", slots[keep], 0.04, dims[1])
    assert rel(got[keep], ref) < BF16


def far_rows_case(gen) -> tuple[tuple, int]:
    """((q_nope, q_rope, cache, slots), kv_lora_rank) at GLM-5.3's shapes with every selected row past 2^31 bytes of
    a 2.2 GB fp8_ds_mla cache (202K context x many pages): row offsets must be 64-bit. GPU only."""
    h, dc, dr, k = 64, 512, 64, 256
    n_slots = (1 << 31) // 656 + 40_000
    cache = torch.zeros(n_slots, 656, dtype=torch.uint8, device=DEVICE)
    top = n_slots - 30_000
    cache[top:] = encode_latent(randn(30_000, dc + dr, gen=gen), "fp8_ds_mla", dc)
    slots = torch.randint(top, n_slots, (16, k), generator=gen, device=DEVICE)
    qn, qr = randn(16, h, dc, gen=gen, dtype=torch.bfloat16), randn(16, h, dr, gen=gen, dtype=torch.bfloat16)
    return (qn, qr, cache, slots), dc


# ---- the indexer q as the kernels round it ------------------------------------------------------------
@functools.cache
def _round_q_kernel():
    """A Triton kernel rounding q / s as the prefill kernel does (the interpreter's e4m3 rounding drops a carry
    into the exponent, so torch's rounding is not what the kernel computes there). Built on first use: the
    module imports without Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, s_ptr, o_ptr, N: tl.constexpr, BLOCK: tl.constexpr, FP8: tl.constexpr, DIV_RN: tl.constexpr):
        c = tl.arange(0, BLOCK)
        r = tl.program_id(0) * N + c
        x, s = tl.load(x_ptr + r, mask=c < N), tl.load(s_ptr + tl.program_id(0))
        y = tl.clamp(tl.div_rn(x, s) if DIV_RN else x / s, -448.0, 448.0)
        if FP8:
            tl.store(o_ptr + r, y.to(tl.float8e4nv).to(tl.float32), mask=c < N)
        else:
            tl.store(o_ptr + r, y.to(tl.float16).to(tl.float32), mask=c < N)

    return kernel


def kernel_q(q, fp8, reciprocal=False):
    """q as the kernel multiplies it (float64): q / s rounded to e4m3 (or fp16) times s, one s = amax / 448
    per (token, head). reciprocal: s = amax x fp32(1/448) on any device and an IEEE division by it (the prefill
    kernels' rule, `triton_indexer_gemm.prepare_q`'s and the streaming kernel's: what torch's `/ 448.0` computes
    on a GPU), else torch's `/ 448.0` on this device (a division on the CPU) and Triton's approximate one."""
    x = q.float().contiguous()
    amax = x.abs().amax(-1).clamp(min=1e-12)
    scale = amax * (1.0 / 448.0) if reciprocal else amax / 448.0
    y = torch.empty_like(x)
    n = x.shape[-1]  # prepare_q: div_rn
    _round_q_kernel()[(scale.numel(),)](x, scale, y, N=n, BLOCK=1 << (n - 1).bit_length(), FP8=fp8, DIV_RN=reciprocal)
    return y.double() * scale.double()[..., None]


def decode_q(q: torch.Tensor, layout) -> torch.Tensor:
    """q as the decode score kernel multiplies it (float64): the FP8 layouts' page-major kernel rounds q / s to
    e4m3 (fp16 with DSASERVE_FP8_ACTIVATIONS=0) with prepare_q's rule; the plain layouts' kernel takes q as it is."""
    from dsaserve.common import envs
    from dsaserve.common.kv_layout import get_kv_layout

    if get_kv_layout(layout).plain_dtype:
        return q.double()
    return kernel_q(q, envs.DSASERVE_FP8_ACTIVATIONS != "0", reciprocal=True)


def sorted_true_scores(sel, q, w, cache, table, req, pos, ps):
    keys = index_keys(cache, "fp8_ds_mla", q.shape[-1]).double()
    out = []
    for t in range(len(pos)):
        row = sel[t][sel[t] >= 0]
        out.append(((q[t].double() @ keys[row].t()).relu() * w[t, :, None].double()).sum(0).sort().values)
    return out


def assert_within_q_rounding(got, ref, q, qk, w, cache, table, req, pos, ps, seed: int) -> None:
    """Every selected true score is within twice the largest score change that rounding q to the kernel's qk
    makes (the bound for a top-k of perturbed scores): near-ties at the k-th may part, nothing else."""
    keys = index_keys(cache, "fp8_ds_mla", q.shape[-1]).double()
    # |score change| <= sum_h |w_h| |dq_h| . |k| = |k| . v, v = sum_h |w_h| |dq_h|: per token, over every key
    v = (w.double().abs()[..., None] * (qk - q.double()).abs()).sum(1)
    bound = 2 * (v @ keys.abs().t()).amax(1) + 1e-9
    for t, (a, b) in enumerate(zip(sorted_true_scores(got, q, w, cache, table, req, pos, ps),
                                   sorted_true_scores(ref, q, w, cache, table, req, pos, ps), strict=True)):
        assert a.shape == b.shape and (a - b).abs().max() <= bound[t], f"seed {seed} token {t}"
