"""A real, small tokenizer for random-weight checkpoints (written by `make-checkpoint`).

Owns: building a byte-level BPE with the `tokenizers` library, trained on a corpus embedded here, and
writing `tokenizer.json`, `tokenizer_config.json` (the family's special tokens; the GLM-5 chat template for
`glm_moe_dsa`, none for `deepseek_v32`, whose prompts are encoded in Python as the real checkpoint's are) and
`special_tokens_map.json`. Startup chain: the server's TokenizerManager and `dsaserve generate` load
these files through transformers' AutoTokenizer exactly as they would a real GLM-5 / DeepSeek one.

Fixed ids: 0 bos, 1 eos (and pad) — GLM: `[gMASK]`, `<|endoftext|>`, then `<sop>` and the role markers;
DeepSeek-V3.2: `<｜begin▁of▁sentence｜>`, `<｜end▁of▁sentence｜>`, pad, `<｜User｜>`, `<｜Assistant｜>`. The
non-special added tokens (`<think>`, `</think>`, GLM's `<tool_call>` / `<arg_key>` / ...) take the last ids.
Byte-level means every UTF-8 string encodes and decodes back unchanged, with no unknown token.
The vocabulary is min(vocab_size, 512): the model's embedding may be larger (ids past the tokenizer
are valid model outputs that decode to nothing) but never smaller.
Determinism: one training string, a tie-breaking trainer, sorted-key JSON -> the same files every time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from dsaserve.config import ModelConfig
from dsaserve.weights.chat_templates import (
    DEEPSEEK_V32_ADDED_TOKENS,
    DEEPSEEK_V32_SPECIAL_TOKENS,
    GLM5_ADDED_TOKENS,
    GLM5_CHAT_TEMPLATE,
)

BOS, EOS, SOP = "[gMASK]", "<|endoftext|>", "<sop>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
SPECIAL_TOKENS = (BOS, EOS, SOP, *ROLE_TOKENS)  # ids 0, 1, 2, ... in this order
MAX_VOCAB = 512  # enough merges for a readable tokenisation, small enough to train in ~10 ms
BYTE_ALPHABET = 256

CHAT_TEMPLATE = GLM5_CHAT_TEMPLATE  # the GLM family's; DeepSeek-V3.2 ships none (encoded in Python)


@dataclass(frozen=True)
class TokenizerFamily:
    special: tuple[str, ...]  # ids 0, 1, ... in this order: bos, eos first
    added: tuple[str, ...]  # non-special added tokens (kept by skip_special_tokens), at the end of the vocab
    chat_template: str | None


FAMILIES = {
    "glm_moe_dsa": TokenizerFamily(SPECIAL_TOKENS, GLM5_ADDED_TOKENS, GLM5_CHAT_TEMPLATE),
    "deepseek_v32": TokenizerFamily(DEEPSEEK_V32_SPECIAL_TOKENS, DEEPSEEK_V32_ADDED_TOKENS, None),
}


def family(cfg: ModelConfig) -> TokenizerFamily:
    return FAMILIES.get(getattr(cfg, "model_type", ""), FAMILIES["glm_moe_dsa"])


# Training text: plain English and a little Python/JSON, so common words and code idioms get merges.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A language model reads a sequence of tokens and predicts
the next one. Serving a model means answering many requests at once: the scheduler picks which
requests run in the next step, the model runs one forward pass over the whole batch, and the sampler
chooses one token for each request. The key and value cache keeps what the model has already seen, so
each new token only needs the attention over the cache instead of the whole prompt again.
Sparse attention selects a small number of earlier tokens for every query. An indexer scores all the
previous positions cheaply, keeps the top k of them, and the attention then reads only those. This is
what makes a context of one million tokens affordable: the cost of a step grows with k, not with the
length of the context. The mixture of experts layer sends every token to a few experts out of many;
a router computes a score for every expert, and the token goes to the experts with the highest score.
There is also a shared expert that every token visits. Weights are stored in eight bit floating point
numbers with one scale for each block of one hundred and twenty eight by one hundred and twenty eight.
Hello, world! How are you today? I am fine, thank you. What is the weather like in the city? It is
sunny and warm, with a light wind from the west. Please write a short story about a robot who learns
to paint. Once upon a time, there was a small robot that lived in a quiet workshop by the sea.
Every morning it watched the light on the water and tried to remember the colours.
Question: what is two plus three? Answer: two plus three is five. Question: what is the capital of
France? Answer: the capital of France is Paris. The numbers are 0 1 2 3 4 5 6 7 8 9 10 100 1000 2048.

def forward(self, hidden_states, positions, kv_cache):
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states = self.self_attn(hidden_states, positions, kv_cache)
    hidden_states = residual + hidden_states
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    return residual + self.mlp(hidden_states)


class Scheduler:
    def __init__(self, config, kv_pool):
        self.config = config
        self.kv_pool = kv_pool
        self.waiting = []
        self.running = []

    def step(self):
        batch = self.schedule()
        if batch is None:
            return []
        return self.run_batch(batch)


for i in range(len(tokens)):
    if tokens[i] == eos_token_id:
        break
    print(f"token {i}: {tokens[i]}")

{"model": "glm-5.3", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16, "stream": true}
import torch
x = torch.randn(4, 8, dtype=torch.float32)
y = torch.nn.functional.softmax(x @ x.T, dim=-1)
return {"id": request_id, "object": "chat.completion", "choices": [{"index": 0, "message": message}]}
"""


def tokenizer_vocab_size(cfg: ModelConfig) -> int:
    return min(cfg.vocab_size, MAX_VOCAB)


def _check_ids(cfg: ModelConfig) -> None:
    fam = family(cfg)
    need = BYTE_ALPHABET + len(fam.special) + len(fam.added)
    if cfg.vocab_size < need:
        raise ValueError(f"vocab_size: {cfg.vocab_size} is too small for a byte-level tokenizer (needs >= {need})")
    if cfg.bos_token_id is not None and cfg.bos_token_id != 0:
        raise ValueError(f"bos_token_id: the built-in tokenizer has {fam.special[0]} at id 0, "
                         f"config says {cfg.bos_token_id}")
    eos = cfg.eos_token_id[0]
    if eos < tokenizer_vocab_size(cfg) and eos != 1:
        raise ValueError(f"eos_token_id: the built-in tokenizer has {fam.special[1]} at id 1, config says {eos}")


def train_bpe(texts, vocab_size: int, fam: TokenizerFamily | None = None) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens trained on an iterable of strings (deterministic): the
    family's special tokens at ids 0.. (GLM's by default), the merges, then its non-special added tokens
    (`<think>`, `<tool_call>`, ...) at the last ids."""
    fam = fam or FAMILIES["glm_moe_dsa"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(fam.added), min_frequency=2, show_progress=False,
        special_tokens=list(fam.special), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    # Merge order is fixed: counts are sums (thread order cannot change them) and the trainer breaks count
    # ties by pair id; the full byte alphabet up front makes the pair ids independent of word order.
    tok.train_from_iterator(texts, trainer=trainer)
    for i, t in enumerate(fam.special):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"tokenizer: special token {t} got id {tok.token_to_id(t)}, expected {i}")
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.added])
    return tok


def build_tokenizer(cfg: ModelConfig) -> Tokenizer:
    """Train the byte-level BPE for cfg (deterministic: same cfg -> same tokenizer)."""
    _check_ids(cfg)
    return train_bpe([CORPUS], tokenizer_vocab_size(cfg), family(cfg))


def tokenizer_config(cfg: ModelConfig) -> dict:
    fam = family(cfg)
    out = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": fam.special[0],
        "eos_token": fam.special[1],
        "pad_token": fam.special[1],
        "additional_special_tokens": list(fam.special[2:]),
        "model_max_length": cfg.max_position_embeddings,
        "clean_up_tokenization_spaces": False,  # decoding must give back the exact text
        "padding_side": "left",
    }
    if fam.chat_template is not None:
        out["chat_template"] = fam.chat_template
    return out


def write_tokenizer(cfg: ModelConfig, out_dir: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    save_tokenizer(build_tokenizer(cfg), cfg, out_dir)


def save_tokenizer(tok: Tokenizer, cfg: ModelConfig, out_dir: str | Path) -> None:
    """Write a trained tokenizer's three files (chat template, special tokens) into out_dir."""
    _check_ids(cfg)
    out = Path(out_dir)
    # Round-trip through json so the file is sorted-key and independent of the library's map order.
    (out / "tokenizer.json").write_text(json.dumps(json.loads(tok.to_str()), indent=2, sort_keys=True,
                                                   ensure_ascii=False) + "\n", encoding="utf-8")
    conf = tokenizer_config(cfg)
    (out / "tokenizer_config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    special = {k: conf[k] for k in ("bos_token", "eos_token", "pad_token", "additional_special_tokens")}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2, sort_keys=True) + "\n")
