"""The HF oracle with a KV layout's codec (dsaserve/quality/hf_oracle.py), on the tiny random checkpoint:
the fp32 codec is exact, a quantised one changes HF's logits only inside the block, and it rounds what the
engine stores at the point the engine stores it (after the RMSNorm / LayerNorm and the RoPE)."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from dsaserve.common.index_pages import read_rows
from dsaserve.common.kv_layout import get_kv_layout
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import contiguous_batch
from dsaserve.quality.hf_oracle import hf_model, kv_codec

MODEL = "glm-5.3-tiny"
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(40)]  # > 4 x index_topk: the indexer selects


@torch.no_grad()
def _logits(model, kv_layout: str | None) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    with kv_codec(model, cache, kv_layout):
        return model(torch.tensor([PROMPT]), past_key_values=cache, use_cache=True).logits[0]


def test_fp32_codec_is_exact_fp8_rounds_and_hf_is_restored_after_the_block(tiny_checkpoint):
    model = hf_model(str(tiny_checkpoint(MODEL)))
    plain = _logits(model, None)
    assert torch.equal(_logits(model, "fp32"), plain)
    fp8 = _logits(model, "fp8_ds_mla")
    assert float((fp8 - plain).abs().max()) > 1e-3  # the codec really ran
    assert not any("expand_kv" in vars(layer.self_attn) for layer in model.model.layers)
    assert torch.equal(_logits(model, None), plain)


def _far(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of the values of a and b further apart than float32 noise (rel 1e-4)."""
    return float(((a - b).abs() > 1e-4 * b.abs() + 1e-7).float().mean())


@torch.no_grad()
def test_the_codec_rounds_what_the_engine_stores_where_it_stores_it(tiny_checkpoint):
    """Layer 0 reads the same embeddings in both models: the latent and the indexer keys HF reads inside
    `kv_codec` are the engine's pool rows decoded, but for the rare value an ulp from an FP8 / BF16 rounding
    boundary (one step off; measured 0 of 5760 latent and 0 of 1280 key values). A codec applied before the
    norm, before the RoPE, or with another scale would miss everywhere."""
    ckpt, layout = tiny_checkpoint(MODEL), get_kv_layout("fp8_ds_mla")
    model = hf_model(str(ckpt))
    seen: dict[str, torch.Tensor] = {}
    attn = model.model.layers[0].self_attn
    cache = DynamicCache(config=model.config)
    # recorders as instance attributes, under the codec's wrappers (which delete them on the way out)
    attn.expand_kv = lambda nope, rot: (seen.setdefault("latent", torch.cat([nope, rot], -1)[0, 0]),
                                        type(attn).expand_kv(attn, nope, rot))[1]
    cache.update_indexer = lambda k, i: (seen.setdefault(f"index{i}", k[0]),
                                         DynamicCache.update_indexer(cache, k, i))[1]
    with kv_codec(model, cache, layout.name):
        model(torch.tensor([PROMPT]), past_key_values=cache, use_cache=True)
    runner = ModelRunner.from_kwargs(MODEL, kv_layout=layout.name, device="cpu", num_pages=4)
    runner.model(contiguous_batch([PROMPT], [0], [0]), runner.kv_pool)
    n = len(PROMPT)
    ours = layout.decode_latent(runner.kv_pool.kv_cache(0)[:n], attn.kv_lora_rank)
    keys = layout.decode_index_k(read_rows(runner.kv_pool.index_cache(0), torch.arange(n), layout,
                                           runner.cfg.index_head_dim))
    assert _far(ours, seen["latent"]) < 1e-3 and _far(keys, seen["index0"]) < 1e-3
    torch.testing.assert_close(ours, seen["latent"], rtol=0.13, atol=1e-6)  # at most one FP8 step (2^-3) apart
    torch.testing.assert_close(keys, seen["index0"], rtol=0.13, atol=1e-6)
