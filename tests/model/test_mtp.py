"""The MTP layer's forward matches a plain re-implementation from the checkpoint's own weights.

transformers ignores layer N (the MTP layer), so the reference here is written from its definition:
h' = eh_proj([enorm(embed(t+1)) ; hnorm(hidden(t))]) -> one decoder layer (HF's decoder layer class, loaded
with layer N's weights) -> shared_head.norm -> the shared lm_head.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from dsaserve.config import load_config
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import contiguous_batch
from dsaserve.quality.hf_oracle import hf_model
from dsaserve.training.export import hf_state_from_checkpoint, read_checkpoint


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_mtp(ckpt, prompt):
    import transformers

    raw = json.loads((ckpt / "config.json").read_text())
    n, eps = raw["num_hidden_layers"], raw["rms_norm_eps"]
    main = hf_model(str(ckpt))
    hidden = main.model(torch.tensor([prompt])).last_hidden_state[0]  # after model.norm
    w = read_checkpoint(ckpt)
    one = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "quantization_config")}
    one.update(num_hidden_layers=1, mlp_layer_types=["sparse"], indexer_types=["full"], first_k_dense_replace=0)
    one.pop("index_topk_freq", None)
    one.pop("index_skip_topk_offset", None)
    cfg_cls = {"glm_moe_dsa": transformers.GlmMoeDsaConfig, "deepseek_v32": transformers.DeepseekV32Config}
    lm_cls = {"glm_moe_dsa": transformers.GlmMoeDsaForCausalLM, "deepseek_v32": transformers.DeepseekV32ForCausalLM}
    cfg = cfg_cls[raw["model_type"]](**one)
    cfg._attn_implementation = "eager"
    layer_model = lm_cls[raw["model_type"]](cfg).float().eval()
    sd = {"model.layers.0." + k.removeprefix("mtp."): v  # the trainer's mapping puts layer n under mtp.
          for k, v in hf_state_from_checkpoint(load_config(ckpt), w).items() if k.startswith("mtp.")}
    sd = {k: v for k, v in sd.items() if not re.search(r"\.(enorm|hnorm|eh_proj|shared_head)\.", k)}
    layer_model.load_state_dict(sd, strict=False)
    p = f"model.layers.{n}"
    emb = w["model.embed_tokens.weight"][torch.tensor(prompt[1:])]
    x = torch.cat([_rms(emb, w[f"{p}.enorm.weight"], eps), _rms(hidden[:-1], w[f"{p}.hnorm.weight"], eps)], -1)
    h = x @ w[f"{p}.eh_proj.weight"].t()
    pos = torch.arange(len(prompt) - 1)[None]
    emb_rot = layer_model.model.rotary_emb(h[None], pos)
    mask = torch.full((len(prompt) - 1,) * 2, float("-inf")).triu(1)[None, None]
    out = layer_model.model.layers[0](h[None], attention_mask=mask, position_embeddings=emb_rot, position_ids=pos)
    out = out[0] if isinstance(out, tuple) else out  # GLM's layer also returns its top-k indices
    return _rms(out[0], w[f"{p}.shared_head.norm.weight"], eps) @ w["lm_head.weight"].t()


@pytest.mark.parametrize("name", ["glm-5.3-tiny", "deepseek-v3.2-tiny"])
def test_mtp_layer_matches_plain_reimplementation(name):
    runner = ModelRunner.from_kwargs(name, kv_layout="fp32", load_mtp=True)
    prompt = torch.randint(2, runner.cfg.vocab_size, (5 * runner.cfg.index_topk,),
                           generator=torch.Generator().manual_seed(3)).tolist()
    batch = contiguous_batch([prompt], [0], [0])
    _, hidden = runner.model(batch, runner.kv_pool)
    mtp_batch = contiguous_batch([prompt[1:]], [0], [0])
    mtp_batch.logits_indices = torch.arange(len(prompt) - 1)
    ours = runner.model.forward_mtp(mtp_batch, runner.kv_pool, hidden[:-1])
    ref = _reference_mtp(runner.checkpoint, prompt)
    assert ours.shape == ref.shape
    assert torch.allclose(ours, ref, atol=2e-3, rtol=0), float((ours - ref).abs().max())
