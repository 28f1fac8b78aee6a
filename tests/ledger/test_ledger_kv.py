"""KV bytes per token (the layouts) and KV-pool capacity."""

from __future__ import annotations

import pytest

from dsaserve.config import load_config
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.kv import (
    indexer_bytes_per_token_layer,
    kv_bytes_per_token_layer,
    kv_capacity,
    kv_per_token,
    prefix_hit,
)

GLM = load_config("glm-5.3")


def test_fp8_ds_mla_is_656_bytes_512_fp8_plus_four_fp32_scales_plus_64_bf16_rope():
    assert kv_bytes_per_token_layer(GLM, "fp8_ds_mla") == 512 + 4 * 4 + 64 * 2 == 656


def test_indexer_key_is_132_bytes_128_fp8_plus_one_fp32_scale():
    assert indexer_bytes_per_token_layer(GLM, "fp8_ds_mla") == 128 + 4 == 132


@pytest.mark.parametrize("layout, main, idx", [("fp8_e4m3", 576, 132), ("bf16", 1152, 256), ("fp32", 2304, 512),
                                               ("nvfp4_ds_mla", 256 + 32 + 64, 132)])
def test_other_layouts(layout: str, main: int, idx: int):
    assert kv_bytes_per_token_layer(GLM, layout) == main
    assert indexer_bytes_per_token_layer(GLM, layout) == idx


def test_nvfp4_with_bf16_rope_is_416_bytes():
    assert kv_bytes_per_token_layer(GLM, "nvfp4_ds_mla", nvfp4_rope="bf16") == 256 + 32 + 128


def test_glm_token_is_53940_bytes_over_78_main_and_21_indexer_layers():
    kv = kv_per_token(GLM, "fp8_ds_mla", Assumptions())
    assert (kv.main, kv.indexer, kv.total) == (78 * 656, 21 * 132, 53_940)
    assert kv.total * 2**20 == 56_560_189_440  # 56.6 GB per 1M-token request, not "53.9 GB"


def test_deepseek_v32_has_every_layer_full():
    kv = kv_per_token(load_config("deepseek-v3.2"), "fp8_ds_mla", Assumptions())
    assert (kv.kv_layers, kv.indexer_layers, kv.total) == (61, 61, 61 * 656 + 61 * 132)


def test_speculation_adds_the_mtp_layers_kv():
    kv = kv_per_token(GLM, "fp8_ds_mla", Assumptions(speculative=True))
    assert (kv.kv_layers, kv.indexer_layers) == (79, 22)


def _cap(dep: Deployment, **asm):
    li = LedgerInputs(GLM, dep, PRESETS["h200"].with_overrides(hbm_bytes=141e9), Workload(), Assumptions(**asm))
    return li, kv_capacity(GLM, dep, li.hw, li.work, li.asm, li.weights_per_gpu)


def test_pool_is_static_share_minus_weights_and_reserved():
    li, cap = _cap(Deployment(tp=8), reserved_bytes=2e9)
    assert cap.pool_bytes == pytest.approx(0.85 * 141e9 - li.weights_per_gpu - 2e9)
    assert cap.pages_per_gpu == int(cap.pool_bytes // (53_940 * 64))
    assert cap.tokens_per_gpu == cap.pages_per_gpu * 64


def test_layer_split_stores_one_eighth_per_gpu_but_the_cluster_holds_what_one_gpu_holds():
    _, split = _cap(Deployment(tp=8), mla_kv="split")
    _, repl = _cap(Deployment(tp=8), mla_kv="replicated")
    assert split.bytes_per_token_gpu == 53_940 / 8
    assert split.tokens_per_gpu == pytest.approx(8 * repl.tokens_per_gpu, rel=1e-3)
    assert split.cluster_tokens == split.tokens_per_gpu  # each token sits on all 8 GPUs


def test_dp_attention_requests_do_not_straddle_ranks():
    _, cap = _cap(Deployment(tp=8, ep=8, dp_attention=True))
    assert cap.cluster_tokens == 8 * cap.tokens_per_gpu
    assert cap.requests_fit == 8 * (cap.pages_per_gpu // cap.request_pages)
    assert cap.requests_fit == 0  # a 1M request (56.6 GB) does not fit one rank's ~22 GB pool


def test_no_memory_left_gives_an_empty_pool_not_a_negative_one():
    _, cap = _cap(Deployment(tp=1))
    assert cap.pool_bytes == 0 and cap.tokens_per_gpu == 0 and cap.requests_fit == 0


def test_requests_fit_falls_as_context_grows():
    li, _ = _cap(Deployment(tp=8), mla_kv="split")
    fits = [li.capacity(c).requests_fit for c in (4096, 32768, 131072, 2**20)]
    assert fits == sorted(fits, reverse=True) and fits[0] > fits[-1]


def test_prefix_hit_shares_only_full_pages():
    assert prefix_hit(20_000, 19_000, 64) == (296, 296 * 64, 20_000 - 296 * 64)
    assert prefix_hit(100, 63, 64) == (0, 0, 100)
