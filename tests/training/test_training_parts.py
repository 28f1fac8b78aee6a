"""The trainer's additions to HF's model (indexer KL, MTP layer, load balancing), the eval's checkpoint
variants, and the packaged built-in checkpoint path."""

from __future__ import annotations

import json

import torch

from dsaserve.config import load_config
from dsaserve.quality.variants import EXTRA_SHARD, make_variant
from dsaserve.training.hf_model import MiniLM, RouterBalancer, indexer_kl
from dsaserve.weights import checkpoint_cache
from dsaserve.weights.checkpoint_writer import write_checkpoint


def test_indexer_kl_is_zero_at_the_target_and_positive_elsewhere():
    torch.manual_seed(0)
    s = 6
    scores = torch.randn(2, s, s)
    topk = torch.arange(s).expand(2, s, s).contiguous()  # everything selected
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    target = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    assert float(indexer_kl(scores, topk, target)) < 1e-6
    assert float(indexer_kl(torch.zeros_like(scores), topk, target)) > 1e-3
    # only the selected keys count: a target mass outside the selection does not matter
    sel = topk[..., :2]
    assert float(indexer_kl(scores, sel, target)) >= 0


def test_indexer_loss_trains_only_the_indexers_and_mtp_gets_gradients():
    cfg = load_config("glm-5.3-tiny")
    torch.manual_seed(0)
    model = MiniLM(cfg).train()
    model.set_index_topk(8)
    out = model(torch.randint(0, cfg.vocab_size, (2, 33)))
    out.indexer_kl.backward(retain_graph=True)
    indexer = [n for n, p in model.named_parameters() if ".indexer." in n]
    assert indexer and all(model.get_parameter(n).grad is not None for n in indexer)
    others = [n for n, p in model.named_parameters() if ".indexer." not in n and p.grad is not None]
    assert others == []
    model.zero_grad()
    (out.lm + out.mtp).backward()
    assert model.mtp.eh_proj.weight.grad.abs().sum() > 0
    assert all(model.get_parameter(n).grad is None for n in indexer)  # top-k is not differentiable


def test_balancer_moves_bias_towards_the_idle_experts():
    cfg = load_config("glm-5.3-tiny")
    torch.manual_seed(0)
    model = MiniLM(cfg).train()
    bal = RouterBalancer(model, 0.01)
    gate = bal.gates[0]
    with torch.no_grad():
        gate.weight.zero_()
        gate.weight[0] = 1.0  # expert 0 wins everywhere it can
    model(torch.randint(0, cfg.vocab_size, (2, 17)))
    counts = bal.counts[0].clone()
    bal.step()
    bias = gate.e_score_correction_bias
    assert counts.sum() > 0 and float(bias[counts.argmax()]) < 0 < float(bias[counts.argmin()])


def test_variants(tmp_path):
    ckpt = write_checkpoint(load_config("glm-5.3-tiny"), tmp_path / "ckpt")
    dense = make_variant(ckpt, "dense", tmp_path, context=100)
    assert json.loads((dense / "config.json").read_text())["index_topk"] == 128
    full = make_variant(ckpt, "all_full", tmp_path)
    cfg = load_config(full)
    assert cfg.shared_indexer_layers == () and (full / EXTRA_SHARD).is_file()
    from dsaserve.training.export import read_checkpoint

    w = read_checkpoint(full)
    types = load_config(ckpt).indexer_types
    for layer, kind in enumerate(types):
        if kind == "shared":
            src = max(i for i in range(layer) if types[i] == "full")
            a = w[f"model.layers.{layer}.self_attn.indexer.wk.weight"]
            assert torch.equal(a, w[f"model.layers.{src}.self_attn.indexer.wk.weight"])
    assert make_variant(ckpt, "base", tmp_path) == ckpt


def test_packaged_builtin_wins_over_the_random_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint_cache, "BUILTIN_ROOT", tmp_path)
    assert checkpoint_cache.packaged_checkpoint("glm-5.3-mini") is None
    write_checkpoint(load_config("glm-5.3-tiny"), tmp_path / "glm-5.3-mini")
    assert checkpoint_cache.resolve_checkpoint("glm-5.3-mini") == tmp_path / "glm-5.3-mini"
    assert checkpoint_cache.packaged_checkpoint("../x") is None


def test_trainable_indexer_selects_what_hf_selects():
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    from dsaserve.training.hf_model import _indexer_scores

    cfg = load_config("glm-5.3-tiny")
    torch.manual_seed(1)
    model = MiniLM(cfg)
    ix = model.indexer.indexers[0]
    s = 40
    h, qr = torch.randn(2, s, cfg.hidden_size), torch.randn(2, s, cfg.q_lora_rank)
    pe = model.lm.model.rotary_emb(h, torch.arange(s)[None])
    mask = torch.full((s, s), float("-inf")).triu(1)[None]
    ours = _indexer_scores(ix, h, qr, pe, mask).topk(cfg.index_topk).indices.sort(-1).values
    ref = GlmMoeDsaIndexer.forward(ix, h, qr, pe, mask, None).sort(-1).values
    assert torch.equal(ours.int(), ref)

