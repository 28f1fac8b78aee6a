"""KVLayout: one object per layout serves the CLI choices, the pool, the codec and the ledger's bytes."""

from __future__ import annotations

import pytest
import torch

from dsaserve.common.kv_layout import ENGINE_KV_LAYOUTS, KV_LAYOUTS, get_kv_layout
from dsaserve.config import load_config
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.kv_pool import KVPool
from dsaserve.ledger.kv import indexer_bytes_per_token_layer, kv_bytes_per_token_layer

GLM = load_config("glm-5.3")
TINY = load_config("glm-5.3-tiny")


@pytest.mark.parametrize("name, main, idx", [("fp8_ds_mla", 656, 132), ("fp8_e4m3", 576, 132),
                                             ("bf16", 1152, 256), ("fp32", 2304, 512), ("nvfp4_ds_mla", 352, 132)])
def test_glm_bytes_per_token_and_layer(name: str, main: int, idx: int):
    layout = KV_LAYOUTS[name]
    assert (layout.kv_bytes_per_token(GLM), layout.indexer_bytes_per_token(GLM)) == (main, idx)
    assert sum(b for _, b in layout.kv_parts(GLM)) == main


def test_the_engine_serves_every_layout_but_the_planning_one():
    assert ENGINE_KV_LAYOUTS == ("fp8_ds_mla", "fp8_e4m3", "bf16", "fp32")
    assert EngineArgs.__dataclass_fields__["kv_layout"].metadata["choices"] == ENGINE_KV_LAYOUTS
    with pytest.raises(ValueError, match="kv_layout: 'nvfp4_ds_mla' not one of fp8_ds_mla"):
        get_kv_layout("nvfp4_ds_mla")
    assert get_kv_layout("nvfp4_ds_mla", engine=False) is KV_LAYOUTS["nvfp4_ds_mla"]
    with pytest.raises(ValueError, match="--kv-layout: 'fp4'"):
        get_kv_layout("fp4", "--kv-layout", engine=False)


@pytest.mark.parametrize("name", ENGINE_KV_LAYOUTS)
def test_pool_and_ledger_read_the_same_object(name: str):
    pool = KVPool(TINY, 2, name)
    assert pool.layout is KV_LAYOUTS[name]
    assert pool.kv_bpt == kv_bytes_per_token_layer(TINY, name) == pool.kv_buffer.shape[-1]
    assert pool.idx_bpt == indexer_bytes_per_token_layer(TINY, name) == pool.index_buffer.shape[-1]
    assert pool.info().layout == name


@pytest.mark.parametrize("name", ENGINE_KV_LAYOUTS)
def test_codec_rows_are_the_layout_bytes_and_round_trip(name: str):
    layout, dc = KV_LAYOUTS[name], TINY.kv_lora_rank
    latent = torch.randn(5, TINY.kv_latent_dim)
    rows = layout.encode_latent(latent, dc)
    assert rows.dtype == torch.uint8 and rows.shape == (5, layout.kv_bytes_per_token(TINY))
    back = layout.decode_latent(rows, dc).float()
    tol = 0 if name == "fp32" else 0.07
    assert torch.allclose(back, latent, atol=tol * latent.abs().max().item(), rtol=0)
    k = torch.randn(5, TINY.index_head_dim)
    krows = layout.encode_index_k(k)
    assert krows.shape == (5, layout.indexer_bytes_per_token(TINY))
    assert torch.allclose(layout.decode_index_k(krows).float(), k, atol=tol * k.abs().max().item(), rtol=0)
