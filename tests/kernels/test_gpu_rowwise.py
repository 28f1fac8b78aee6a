"""GPU row-wise kernels against their references (RMSNorm with the residual add, SiLU*up, in-place RoPE,
the FP8 copy they attach for the next GEMM), and the registry binding the GPU kernels on CUDA.
Set-up and error bounds: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import (
    BF16_ULP,
    DEVICE,
    FP8A,
    MODELS,
    SMALL_ROWS,
    gpu_modules,
    randn,
    rel,
    requires_gpu_kernels,
)

pytestmark = requires_gpu_kernels


@pytest.mark.parametrize("n", [2048, 6144, 100, 384])  # 384: glm-5.3-mini's hidden size
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_and_residual_add_match_reference(gen, n, dtype):
    from dsaserve.kernels import triton_elementwise as E

    x, r = randn(7, n, gen=gen, dtype=dtype), randn(7, n, gen=gen, dtype=dtype)
    w = randn(n, gen=gen, dtype=dtype)
    tol = BF16_ULP if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(E.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6), **tol)
    y, s = E.add_rms_norm(x, r, w, 1e-6)
    ref_y, ref_s = R.add_rms_norm(x, r, w, 1e-6)
    if DEVICE == "cuda":  # the add rounds exactly as torch's (the interpreter truncates instead)
        assert torch.equal(s, ref_s)
    torch.testing.assert_close(s, ref_s, **tol)
    torch.testing.assert_close(y, ref_y, **tol)


@pytest.mark.parametrize("n", [1, 37, 3000])  # one decode row; a batch; many programs (RESOLVE_BLOCK ids each)
def test_resolve_placeholders_matches_reference(gen, n):
    """Every id -1-j becomes future[j], real ids stay, bit for bit the torch ops (overlap scheduling's placeholders)."""
    from dsaserve.kernels import triton_elementwise as E

    future = torch.randint(0, 50_000, (256,), generator=gen, device=DEVICE)
    ids = torch.randint(0, 50_000, (n,), generator=gen, device=DEVICE)
    late = torch.rand(n, generator=gen, device=DEVICE) < 0.5
    ids = torch.where(late, -1 - torch.randint(0, 256, (n,), generator=gen, device=DEVICE), ids)
    got, want = ids.clone(), ids.clone()
    E.resolve_placeholders(got, future)
    R.resolve_placeholders(want, future)
    assert torch.equal(got, want) and (got >= 0).all()
    assert torch.equal(got[~late], ids[~late])


@pytest.mark.parametrize("t", [1, 37, 300])  # a decode row; a batch; a prefill chunk
@pytest.mark.parametrize("h", [6144, 384, 100])  # GLM's hidden (6 programs a row), mini's, a ragged last block
@pytest.mark.parametrize("placeholders", [False, True])
def test_embed_rope_rows_match_reference(gen, t, h, placeholders):
    """A step's first launch: bit for bit the two `index_select`s, from a table with a row stride wider than its
    row (a view), every row of both outputs written (the poisoned allocator would show a gap); with future tokens
    the placeholder ids resolved in place as `resolve_placeholders` does, and their rows gathered."""
    from dsaserve.kernels import triton_elementwise as E

    vocab, positions_max = 5000, 4096
    weight = randn(vocab, h, gen=gen, dtype=torch.bfloat16)
    table = randn(positions_max, 96, gen=gen, dtype=torch.bfloat16)[:, :64]
    ids = torch.randint(0, vocab, (t,), generator=gen, device=DEVICE)
    ids[0] = vocab - 1  # the last row
    future = torch.randint(0, vocab, (64,), generator=gen, device=DEVICE) if placeholders else None
    if placeholders:
        late = torch.rand(t, generator=gen, device=DEVICE) < 0.5
        ids = torch.where(late, -1 - torch.randint(0, 64, (t,), generator=gen, device=DEVICE), ids)
    positions = torch.randint(0, positions_max, (t,), generator=gen, device=DEVICE)
    got_ids, want_ids = ids.clone(), ids.clone()
    got = E.embed_rope_rows(got_ids, weight, positions, table, future)
    want = R.embed_rope_rows(want_ids, weight, positions, table, future)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert torch.equal(got_ids, want_ids) and (got_ids >= 0).all()
    with pytest.raises(ValueError, match="embed_rope_rows"):
        E.embed_rope_rows(ids[:, None], weight, positions, table)


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned memory read by a kernel: a CUDA device")
@pytest.mark.parametrize("n", [1, 8, 4736, 9000])  # a few ids; b128's narrow inputs; one past HOST_READ_MAX_BYTES
def test_copy_from_host_reads_the_pinned_buffer_as_it_is_at_replay(gen, n):
    """A decode graph's inputs out of their pinned staging buffer: the same int64s as the copy, and a replay of a
    captured copy reads the buffer as it is then (the engine writes it after the capture, before each replay)."""
    from dsaserve.kernels import triton_elementwise as E

    src = torch.randint(-(2**62), 2**62, (n,), generator=torch.Generator().manual_seed(n)).pin_memory()
    dst = torch.zeros(n, dtype=torch.int64, device=DEVICE)
    E.copy_from_host(dst, src)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        E.copy_from_host(dst, src)
    src.sub_(12345)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src)
    with pytest.raises(ValueError, match="copy_from_host"):
        E.copy_from_host(dst[:0], src)  # sizes differ


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned memory read by a kernel: a CUDA device")
@pytest.mark.parametrize("rows,max_deltas", [(5, 3), (640, 3424), (2560, 1100)])  # tiny; b128 at 202,752; past a block
def test_stage_from_host_under_capture_writes_the_counts_changes_as_the_reference(rows, max_deltas):
    """A wide decode graph's inputs and its page table's changes read out of pinned memory by one kernel: at each
    replay the rows and as many changes as the count says then (the reference's result), an index outside the table
    dropped, not stored."""
    from dsaserve.kernels import triton_elementwise as E

    g = torch.Generator().manual_seed(rows)
    table_n = 128 * 3168
    src = torch.zeros(rows, dtype=torch.int64).pin_memory()
    changes = torch.zeros(1 + 2 * max_deltas, dtype=torch.int64).pin_memory()
    got_rows = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    got, want = (torch.zeros(table_n, dtype=torch.int64, device=DEVICE) for _ in range(2))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        E.stage_from_host(got_rows, src, got, changes, max_deltas)
    for count in (0, 1, max_deltas // 2 + 1, max_deltas):
        src.copy_(torch.randint(0, 2**40, (rows,), generator=g))
        changes[0] = count
        changes[1:1 + max_deltas] = torch.randperm(table_n, generator=g)[:max_deltas]
        changes[1 + max_deltas:] = torch.randint(0, 2**40, (max_deltas,), generator=g)
        graph.replay()
        R.stage_from_host(torch.zeros_like(got_rows), src, want, changes, max_deltas)
        torch.cuda.synchronize()
        assert torch.equal(got_rows.cpu(), src) and torch.equal(got, want), f"count {count}"
    changes[0], changes[1] = 1, table_n  # one past the table
    before = got.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, before)


@pytest.mark.parametrize("inter", [2500, 128, 1024])  # an odd width; mini's experts and dense MLP
def test_silu_and_mul_matches_reference(gen, inter):
    from dsaserve.kernels import triton_elementwise as E

    x = randn(5, 2 * inter, gen=gen, dtype=torch.bfloat16)
    torch.testing.assert_close(E.silu_and_mul(x), R.silu_and_mul(x), **BF16_ULP)


# (heads, dims before the rope slice, rope dims): every model's q and indexer q, one row, and 12 pairs (not a
# power of two)
ROPE_CASES = sorted({(0, 192, 64), (3, 192, 64), (64, 192, 64), (2, 16, 24)}
                    | {(c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim) for c in MODELS.values()}
                    | {(c.index_n_heads, c.index_head_dim - c.qk_rope_head_dim, c.qk_rope_head_dim)
                       for c in MODELS.values()})


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("heads,nope,rope", ROPE_CASES)
def test_rope_inplace_matches_reference_on_a_view(gen, interleaved, heads, nope, rope):
    from dsaserve.kernels import triton_elementwise as E

    t = 6
    full = randn(t, *([heads] if heads else []), nope + rope, gen=gen, dtype=torch.bfloat16)
    ang = randn(t, rope // 2, gen=gen)
    cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
    want = full.clone()
    want[..., nope:] = R.apply_rope(full[..., nope:], cos, sin, interleaved)
    E.rope_inplace(full[..., nope:], cos, sin, interleaved)
    torch.testing.assert_close(full, want, **BF16_ULP)
    assert torch.equal(full[..., :nope], want[..., :nope])  # the rest of the row is untouched


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "silu_and_mul"])
def test_row_kernels_attach_the_fp8_copy_the_gemm_would_make(gen, op):
    from dsaserve.kernels import triton_elementwise as E
    from dsaserve.kernels import triton_fp8_gemm as G

    n = 2048
    x = randn(3, n if op != "silu_and_mul" else 2 * n, gen=gen, dtype=torch.bfloat16)
    w = randn(n, gen=gen, dtype=torch.bfloat16)
    y = {"rms_norm": lambda: E.rms_norm(x, w, 1e-6), "add_rms_norm": lambda: E.add_rms_norm(x, x, w, 1e-6)[0],
         "silu_and_mul": lambda: E.silu_and_mul(x)}[op]()
    q, s = G.cached_fp8(y)
    ref_q, ref_s = G.quant_act_fp8(y)
    torch.testing.assert_close(s, ref_s)
    assert (q.float() - ref_q.float()).abs().max() <= ref_q.float().abs().max() * 2 ** -3  # <= 1 e4m3 step
    big = randn(SMALL_ROWS + 1, n, gen=gen, dtype=torch.bfloat16)
    assert G.cached_fp8(E.rms_norm(big, w, 1e-6)) is None  # 33 rows: past the skinny rows, not cuBLAS's multiple


@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "silu_and_mul"])
def test_batch_rows_carry_the_copy_in_both_scale_layouts(gen, op, monkeypatch):
    """With `CUBLAS_COPY_MAX_ROWS`, 33+ rows that are a multiple of 16 carry the FP8 copy with its scales row-major
    (the MoE's) and outer-dim-major (cuBLAS's: what `quant_act_fp8(scale_m_major=True)` lays out): the same
    values, the same scales; other row counts carry none."""
    from dsaserve.kernels import triton_elementwise as E
    from dsaserve.kernels import triton_fp8_gemm as G

    monkeypatch.setattr(G, "CUBLAS_COPY_MAX_ROWS", 512)
    n = 1024
    w = randn(n, gen=gen, dtype=torch.bfloat16)
    run = {"rms_norm": lambda x: E.rms_norm(x, w, 1e-6), "add_rms_norm": lambda x: E.add_rms_norm(x, x, w, 1e-6)[0],
           "silu_and_mul": lambda x: E.silu_and_mul(x)}[op]
    for rows in (48, 128):
        y = run(randn(rows, n if op != "silu_and_mul" else 2 * n, gen=gen, dtype=torch.bfloat16))
        (q, s), (q_m, s_m) = G.cached_fp8(y), G.cached_fp8_m_major(y)
        ref_q, ref_s = G.quant_act_fp8(y, pad_m_to=16, scale_m_major=True)
        assert q_m is q and s_m.stride() == (1, rows) and torch.equal(s_m, s)
        torch.testing.assert_close(s_m, ref_s)
        assert (q.float() - ref_q.float()).abs().max() <= ref_q.float().abs().max() * 2 ** -3  # <= 1 e4m3 step
    for rows in (40, 528):  # not cuBLAS's M / past the bound
        y = run(randn(rows, n if op != "silu_and_mul" else 2 * n, gen=gen, dtype=torch.bfloat16))
        assert G.cached_fp8(y) is None and G.cached_fp8_m_major(y) is None


@pytest.mark.skipif(DEVICE != "cuda", reason="cuBLAS's block-scaled GEMM: a Hopper GPU")
@pytest.mark.parametrize("rows, k", [(128, 2048), (64, 4096)])
def test_the_cublas_gemm_takes_the_rows_copy_instead_of_quantising(gen, monkeypatch, rows, k):
    """fp8_linear at 128 rows (cuBLAS) and at 64 rows of K 4096 (the split-K GEMM, where the GPU has it) reads the
    RMSNorm's copy (no quantiser launch) and gives what quantising gives, to the copy's rounding (<= 1 e4m3 step an
    element)."""
    from dsaserve.kernels import gluon_fp8_splitk as SK
    from dsaserve.kernels import triton_elementwise as E
    from dsaserve.kernels import triton_fp8_gemm as G
    from dsaserve.weights.fp8 import quantize_fp8_block

    if not G.scaled_mm_ok(1024, k, torch.device(DEVICE)):
        pytest.skip("not a GPU whose block-scaled cuBLAS GEMM fp8_linear takes")
    w8, ws = quantize_fp8_block(randn(1024, k, gen=gen))
    x, g = randn(rows, k, gen=gen, dtype=torch.bfloat16), randn(k, gen=gen, dtype=torch.bfloat16)
    monkeypatch.setattr(G, "CUBLAS_COPY_MAX_ROWS", 0)
    plain = G.fp8_linear(E.rms_norm(x, g, 1e-6), w8, ws)
    monkeypatch.setattr(G, "CUBLAS_COPY_MAX_ROWS", 512)
    y = E.rms_norm(x, g, 1e-6)
    calls, split_calls = [], []
    quant, splitk = G.quant_act_fp8, SK.fp8_splitk_gemm
    monkeypatch.setattr(G, "quant_act_fp8", lambda *a, **kw: calls.append(1) or quant(*a, **kw))
    monkeypatch.setattr(SK, "fp8_splitk_gemm", lambda *a, **kw: split_calls.append(1) or splitk(*a, **kw))
    got = G.fp8_linear(y, w8, ws)
    assert not calls and rel(got, plain) < FP8A
    want_split = rows <= G.SPLITK_ROWS[1] and G.SPLITK_GEMM and SK.available(x.device)
    assert bool(split_calls) == bool(want_split)


def test_activation_quant_gives_each_row_the_same_bytes_at_any_batch_size(gen):
    """Prefill-size inputs quantise 4 rows a program, decode-size ones 1: a row's e4m3 bytes and scales do not
    depend on which; padding rows are zeros; each 128-group dequantises within one e4m3 step."""
    from dsaserve.kernels import triton_fp8_gemm as G

    x = randn(600, 640, gen=gen, dtype=torch.bfloat16) * 3
    q, s = G.quant_act_fp8(x, pad_m_to=64)
    assert q.shape == (640, 640) and s.shape == (640, 5) and not q[600:].float().any()
    for r0 in (0, 255, 597):
        q1, s1 = G.quant_act_fp8(x[r0:r0 + 3])
        assert torch.equal(q1.view(torch.uint8), q[r0:r0 + 3].view(torch.uint8)) and torch.equal(s1, s[r0:r0 + 3])
    back = q[:600].float() * s[:600].repeat_interleave(128, dim=1)
    step = x.float().abs().view(600, 5, 128).amax(-1).repeat_interleave(128, dim=1) * 2 ** -3
    assert ((back - x.float()).abs() <= step).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="the registry picks GPU kernels only on CUDA")
def test_registry_binds_gpu_kernels_on_cuda(set_switch):
    from dsaserve.kernels import registry

    ops = registry.get_ops("cuda")
    from dsaserve.kernels.gluon_common import available

    attention = "gluon" if available(torch.device("cuda")) else "triton"  # the Gluon kernels on sm_90
    assert ops.impls["fused_moe"].startswith("triton") and ops.impls["sparse_mla_attention"].startswith(attention)
    assert ops.fp8_linear is gpu_modules()[0].fp8_linear and ops.graph_safe
    assert ops.impls["row_argmax"].startswith("torch argmax")  # the greedy sampler's: the kernel only when asked
    set_switch("DSASERVE_ROW_ARGMAX", "triton")
    assert registry.get_ops("cuda").impls["row_argmax"].startswith("triton split-row")
    set_switch(registry.FP8_ACT_ENV, "0")
    assert "bf16 activations" in registry.get_ops("cuda").impls["fp8_linear"]
    set_switch(registry.ENV_VAR, "reference")
    assert registry.get_ops("cuda").fp8_linear is R.fp8_linear


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter hook binds the CPU's ops")
def test_registry_binds_the_interpreted_gpu_kernels_on_the_cpu_for_a_block():
    from dsaserve.kernels import registry

    before = registry.get_ops("cpu")
    with registry.interpreted_gpu_ops() as ops:
        assert registry.get_ops("cpu") is ops and ops.rms_norm is not R.rms_norm and not ops.graph_safe
        assert "interpreted" in ops.impls["sparse_mla_attention"] and ops.impls["apply_rope"] == "reference"
    assert registry.get_ops("cpu") is before and before.rms_norm is R.rms_norm
