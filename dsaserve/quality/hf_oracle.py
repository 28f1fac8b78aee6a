"""The numerics oracle: HF transformers' GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM on the same weights,
optionally with a KV layout's codec (`dsaserve eval`'s "hf" group and the HF-comparison tests).

Owns: building the HF model (float32, eager attention, on the CPU) from a dsaserve checkpoint directory (the
trainer's name mapping, `training/export.py`: FP8 weights dequantised with their block scales, experts stacked
as HF stores them; HF ignores the MTP layer, so its tensors are dropped). Greedy continuations (batched per
prompt length) and held-out perplexity of that model.

HF has no quantised KV cache, so a quantised engine layout is compared fairly with `kv_codec`: HF with what
the engine stores - the MLA latent (RMSNorm'd nope | RoPE'd rope, just before HF expands it through
kv_b_proj) and the indexer keys (LayerNorm + RoPE, just before HF caches them) - encoded and decoded by that
layout's codec (`common/kv_layout.py`, the functions the engine's kernels write and read with). HF caches
the K/V it expands from the decoded latent: what the engine reads back for every token, this step's too.
transformers is a test / training dependency, imported when a model is first built.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

import torch

from dsaserve.common.kv_layout import get_kv_layout
from dsaserve.config import load_config
from dsaserve.training.export import hf_state_from_checkpoint, read_checkpoint

MAX_CHECKPOINT_BYTES = 4 << 30  # on disk (mostly FP8): ~4x that in float32 on the host, the oracle's limit


def hf_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """The HF model's state: the trainer's checkpoint mapping (`training/export.py`: FP8 dequantised, experts
    stacked) without the MTP layer, which HF does not have."""
    sd = hf_state_from_checkpoint(load_config(ckpt), read_checkpoint(ckpt))
    return {k.removeprefix("lm."): v for k, v in sd.items() if k.startswith("lm.")}


@lru_cache(maxsize=4)
def hf_model(ckpt: str):
    """HF model in float32, eager attention, with the checkpoint's dequantised weights."""
    import transformers

    raw = json.loads((Path(ckpt) / "config.json").read_text())
    raw.pop("quantization_config", None)
    cls_cfg = {"glm_moe_dsa": transformers.GlmMoeDsaConfig, "deepseek_v32": transformers.DeepseekV32Config}
    cls_model = {"glm_moe_dsa": transformers.GlmMoeDsaForCausalLM, "deepseek_v32": transformers.DeepseekV32ForCausalLM}
    config = cls_cfg[raw["model_type"]](**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = cls_model[raw["model_type"]](config).float().eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(Path(ckpt)), strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    assert not missing and not unexpected, (missing[:5], unexpected[:5])
    return model


@contextlib.contextmanager
def kv_codec(model, cache, kv_layout: str | None) -> Iterator[None]:
    """Within the block, `model`'s attention layers see their latent, and `cache` keeps the indexer keys, as
    `kv_layout` stores them: encoded and decoded by its codec. None: HF as it is (its own float32 cache)."""
    if kv_layout is None:
        yield
        return
    layout = get_kv_layout(kv_layout)
    attns = [layer.self_attn for layer in model.model.layers]

    def latent_codec(expand_kv, rank: int):
        def expand(kv_nope: torch.Tensor, k_rot: torch.Tensor):  # [B, 1, S, rank], [B, 1, S, rope]
            latent = torch.cat([kv_nope, k_rot], dim=-1)
            rows = layout.encode_latent(latent.reshape(-1, latent.shape[-1]), rank)
            back = layout.decode_latent(rows, rank).to(latent.dtype).view(latent.shape)
            return expand_kv(back[..., :rank], back[..., rank:])
        return expand

    def index_codec(update_indexer):
        def update(k: torch.Tensor, layer_idx: int) -> torch.Tensor:  # [B, S, D]
            back = layout.decode_index_k(layout.encode_index_k(k.reshape(-1, k.shape[-1])))
            return update_indexer(back.to(k.dtype).view(k.shape), layer_idx)
        return update

    for a in attns:  # instance attributes shadow the class's methods; deleting them restores HF
        a.expand_kv = latent_codec(a.expand_kv, a.kv_lora_rank)
    cache.update_indexer = index_codec(cache.update_indexer)
    try:
        yield
    finally:
        for a in attns:
            del a.expand_kv
        del cache.update_indexer


@torch.no_grad()
def _forward(model, ids: list[list[int]], kv_layout: str | None, steps: int = 0) -> tuple[torch.Tensor, ...]:
    """Prefill of equal-length sequences, then `steps` greedy decode steps with the cache: every row's logits
    at every prefill position [B, S, V], then the last position's [B, V] of prefill and of each step."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with kv_codec(model, cache, kv_layout):
        out = model(torch.tensor(ids), past_key_values=cache, use_cache=True).logits.float()
        last = [out[:, -1]]
        for _ in range(steps):
            nxt = last[-1].argmax(-1, keepdim=True)
            last.append(model(nxt, past_key_values=cache, use_cache=True).logits[:, -1].float())
    return out, *last


def hf_greedy_batch(ckpt: str | Path, prompts: list[list[int]], n_tokens: int,
                    kv_layout: str | None = None) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy continuations, prompts of one length batched: (ids, logits of prefill's last token and of each
    decode step but the last) per prompt. kv_layout: the cache through that layout's codec (`kv_codec`)."""
    model = hf_model(str(ckpt))
    ids: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    for length in sorted({len(p) for p in prompts}):
        rows = [i for i, p in enumerate(prompts) if len(p) == length]
        _, *steps = _forward(model, [prompts[i] for i in rows], kv_layout, n_tokens - 1)
        for j, i in enumerate(rows):
            logits[i] = [s[j] for s in steps[:n_tokens]]
            ids[i] = [int(x.argmax()) for x in logits[i]]
    return ids, logits


def hf_greedy_logits(ckpt: str | Path, prompt_ids: list[int], n_tokens: int,
                     kv_layout: str | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """One prompt's greedy continuation: (generated ids, logits of prefill's last token and each decode step)."""
    ids, logits = hf_greedy_batch(ckpt, [prompt_ids], n_tokens, kv_layout)
    return ids[0], logits[0]


def hf_perplexity(ckpt: str | Path, wins: list[list[int]], batch: int, kv_layout: str | None = None) -> dict:
    """Mean next-token loss over the windows (each a prefill through the codec, as the engine's eval does)."""
    model = hf_model(str(ckpt))
    nll, n = 0.0, 0
    for i in range(0, len(wins), batch):
        for length in sorted({len(w) for w in wins[i:i + batch]}):
            chunk = [w for w in wins[i:i + batch] if len(w) == length]
            logp = torch.log_softmax(_forward(model, chunk, kv_layout)[0][:, :-1], -1)
            nll -= float(logp.gather(2, torch.tensor(chunk)[:, 1:, None]).sum())
            n += len(chunk) * (length - 1)
    loss = nll / max(n, 1)
    return {"loss": round(loss, 5), "ppl": round(math.exp(loss), 4), "tokens": n}


def run_oracle(model_dir: str, kv_layout: str, wins: list[list[int]], prompts: list[list[int]], n_tokens: int,
               batch: int) -> dict:
    """`run_setting`'s result for HF with `kv_layout`'s codec: perplexity, greedy tokens, top-1 margins."""
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    size = int(index.get("metadata", {}).get("total_size", 0))
    if size > MAX_CHECKPOINT_BYTES:
        raise ValueError(f"hf oracle: checkpoint of {size / 2**30:.1f} GiB is past the float32 CPU oracle's "
                         f"{MAX_CHECKPOINT_BYTES / 2**30:.0f} GiB")
    ppl = hf_perplexity(model_dir, wins, batch, kv_layout)
    toks, logits = hf_greedy_batch(model_dir, prompts, n_tokens, kv_layout)
    margins = []
    for rows in logits:
        top = torch.log_softmax(torch.stack(rows), -1).topk(2, dim=-1).values if rows else torch.zeros(0, 2)
        margins.append([float(m) for m in top[:, 0] - top[:, 1]])
    return {**ppl, "greedy": toks, "margins": margins}
