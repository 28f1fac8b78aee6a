"""q's RoPE fused into the KV writes (`triton_kv_write.mla_kv_write(q_rope=)`, `indexer_k_norm_write(q=)`): the same
bits as the RoPE kernel alone (`rope_inplace`), padded rows (slot -1) rotated too, the cache and the latent as
without q; and the references rotate q the same way (to bf16 rounding: they round each product as torch's ops do).
Both launch shapes: q's head blocks as programs beside the write's (`Q_ROPE_PROGRAMS`), and rotated by the write's
own program in turn.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsaserve.common.kv_layout import encode_index_k, encode_latent
from dsaserve.kernels import reference as R
from tests.kernels.gpu_common import DEVICE, MODELS, gpu_modules, randn, requires_gpu_kernels

pytestmark = requires_gpu_kernels

# each test model's heads, and 20 / 36 heads: a partial head block after full ones (blocks of 16)
CASES = [(name, None) for name in MODELS] + [(next(iter(MODELS)), 20), (next(iter(MODELS)), 36)]


def _angles(gen, t: int, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.rand(t, rope // 2, generator=gen, device=DEVICE) * 6
    return ang.cos().bfloat16(), ang.sin().bfloat16()


def _slots(gen, t: int, n_slots: int) -> torch.Tensor:
    slots = torch.randperm(n_slots, generator=gen, device=DEVICE)[:t]
    slots[2] = -1  # a padded row: writes nothing, its q still rotates
    return slots


@pytest.mark.parametrize("q_programs", [True, False])
@pytest.mark.parametrize("model,heads", CASES)
def test_mla_kv_write_rotates_q_rope_in_its_launch(gen, model, heads, q_programs, monkeypatch):
    from dsaserve.kernels import triton_elementwise as E

    kvw = gpu_modules()[2]
    monkeypatch.setattr(kvw, "Q_ROPE_PROGRAMS", q_programs)
    cfg = MODELS[model] if heads is None else dataclasses.replace(MODELS[model], num_attention_heads=heads)
    t, n_slots, nope = 5, 16, cfg.qk_nope_head_dim
    dc, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    cos, sin = _angles(gen, t, dr)
    slots = _slots(gen, t, n_slots)
    kv_a = randn(t, dc + dr, gen=gen, dtype=torch.bfloat16)
    wt = (torch.rand(dc, generator=gen, device=DEVICE) + 0.5).bfloat16()
    q = randn(t, cfg.num_attention_heads, nope + dr, gen=gen, dtype=torch.bfloat16)
    alone, ref_q = q.clone(), q.clone()
    E.rope_inplace(alone[..., nope:], cos, sin, True)
    assert not torch.equal(alone, ref_q)  # the angles move q
    row = encode_latent(kv_a[:1].float(), "fp8_ds_mla", dc).shape[1]
    caches = [torch.zeros(n_slots, row, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    fused = kvw.mla_kv_write(caches[0], "fp8_ds_mla", slots, kv_a, wt, 1e-5, cos, sin, dc, q[..., nope:])
    plain = kvw.mla_kv_write(caches[1], "fp8_ds_mla", slots, kv_a, wt, 1e-5, cos, sin, dc)
    assert torch.equal(q, alone) and torch.equal(fused, plain) and torch.equal(caches[0], caches[1])
    kept = slots >= 0
    ref_q = ref_q[kept]  # a view's in-place RoPE (the reference's) reaches the tensor it views
    R.mla_kv_write(torch.zeros_like(caches[0]), "fp8_ds_mla", slots[kept], kv_a[kept], wt, 1e-5, cos[kept],
                   sin[kept], dc, ref_q[..., nope:])
    torch.testing.assert_close(q[kept], ref_q, rtol=2 ** -7, atol=1e-2)
    with pytest.raises(ValueError, match="q must be"):  # the RoPE slice exactly: more columns would not rotate
        kvw.mla_kv_write(caches[0], "fp8_ds_mla", slots, kv_a, wt, 1e-5, cos, sin, dc, q[..., nope - 2:])


@pytest.mark.parametrize("q_programs", [True, False])
@pytest.mark.parametrize("model,heads", CASES)
def test_indexer_k_norm_write_rotates_the_queries_in_its_launch(gen, model, heads, q_programs, monkeypatch):
    """The indexer's queries: their first rope dims (GLM interleaved, DeepSeek rotate-half), the key write unchanged."""
    from dsaserve.kernels import triton_elementwise as E

    kvw = gpu_modules()[2]
    monkeypatch.setattr(kvw, "Q_ROPE_PROGRAMS", q_programs)
    cfg = MODELS[model]
    t, n_slots, ps = 5, 16, 8
    d, dr, interleaved = cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.model_type == "glm_moe_dsa"
    cos, sin = _angles(gen, t, dr)
    slots = _slots(gen, t, n_slots)
    k_raw = randn(t, d, gen=gen, dtype=torch.bfloat16, scale=3.0)
    weight, bias = (1 + 0.3 * randn(d, gen=gen)).bfloat16(), (0.2 * randn(d, gen=gen)).bfloat16()
    q = randn(t, heads or cfg.index_n_heads, d, gen=gen, dtype=torch.bfloat16)
    alone, ref_q = q.clone(), q.clone()
    E.rope_inplace(alone[..., :dr], cos, sin, interleaved)
    assert not torch.equal(alone, ref_q)
    width = ps * encode_index_k(k_raw[:1], "fp8_ds_mla").shape[1]
    caches = [torch.zeros(n_slots // ps, width, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
    kvw.indexer_k_norm_write(caches[0], "fp8_ds_mla", slots, k_raw, weight, bias, 1e-6, cos, sin, dr, interleaved, q)
    kvw.indexer_k_norm_write(caches[1], "fp8_ds_mla", slots, k_raw, weight, bias, 1e-6, cos, sin, dr, interleaved)
    assert torch.equal(q, alone) and torch.equal(caches[0], caches[1])
    kept = slots >= 0
    ref_q = ref_q[kept]
    R.indexer_k_norm_write(torch.zeros_like(caches[0]), "fp8_ds_mla", slots[kept], k_raw[kept], weight, bias, 1e-6,
                           cos[kept], sin[kept], dr, interleaved, ref_q)
    torch.testing.assert_close(q[kept], ref_q, rtol=2 ** -7, atol=1e-2)
    with pytest.raises(ValueError, match="q must be"):
        kvw.indexer_k_norm_write(caches[0], "fp8_ds_mla", slots, k_raw, weight, bias, 1e-6, cos, sin, dr,
                                 interleaved, q[:2])
