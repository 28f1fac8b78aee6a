"""A stand-in for ModelRunner that exercises the engine's paging for real, without a model.

Its "KV cache" stores, per slot, the token id and position written there through `out_cache_loc`; the
logits of a request are a deterministic function of the tokens it *reads back through its page table*
(all `seq_lens` of them), and reading a slot that holds the wrong position fails loudly. So a wrong page
table, a page shared or reused while still needed, or a prefix-cache hit on foreign content changes
the output or raises. `fake_greedy` is the oracle: the greedy continuation computed directly.

Tokens 32..126 are printable characters (the FakeTokenizer maps id <-> chr(id)); 1 is EOS; 0..31 are
"special" and decode to nothing.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from dsaserve.engine.overlap import resolve_placeholders_

EOS = 1
VOCAB = 128
_MOD = (1 << 61) - 1


def seq_hash(seq: list[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 1_000_003 + t + 1) % _MOD
    return h


def fake_logits(seq: list[int], vocab: int = VOCAB, eos_every: int = 23) -> torch.Tensor:
    h = seq_hash(seq)
    g = torch.Generator().manual_seed(h)
    logits = torch.randn(vocab, generator=g) * 2.0
    target = EOS if eos_every and h % eos_every == 0 else 32 + h % 95
    logits[target] = logits.max() + 3.0
    return logits


def fake_greedy(prompt: list[int], max_tokens: int, ignore_eos: bool = False, eos_every: int = 23) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        t = int(fake_logits(seq, eos_every=eos_every).argmax())
        out.append(t)
        seq.append(t)
        if t == EOS and not ignore_eos:
            break
    return out


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in ids if t >= 32)


class FakeRunner:
    def __init__(self, num_pages: int = 64, page_size: int = 64, max_position_embeddings: int = 4096,
                 eos_every: int = 23, vocab: int = VOCAB):
        self.cfg = SimpleNamespace(vocab_size=vocab, max_position_embeddings=max_position_embeddings,
                                   eos_token_id=(EOS,))
        self.num_pages, self.page_size, self.device = num_pages, page_size, "cpu"
        self.eos_token_ids = (EOS,)
        self.tokenizer = FakeTokenizer()
        self.chat_template = None
        self.startup_time = {"fake_runner": 0.0}
        self.kv_tok = torch.full((num_pages * page_size,), -1, dtype=torch.int64)
        self.kv_pos = torch.full((num_pages * page_size,), -1, dtype=torch.int64)
        self.eos_every = eos_every
        self.batches: list = []  # every ForwardBatch seen (tests inspect them)
        self.future_token_ids = torch.zeros(256, dtype=torch.int64)  # overlap scheduling reads it (the real runner's)

    def manifest(self) -> dict:
        return {"runner": "fake"}

    def forward(self, batch) -> torch.Tensor:
        resolve_placeholders_(batch.input_ids, self.future_token_ids)  # the step before's samples, as the runner
        self.batches.append(batch)
        assert batch.out_cache_loc.unique().numel() == batch.num_tokens, "two tokens written to one slot"
        self.kv_tok[batch.out_cache_loc] = batch.input_ids
        self.kv_pos[batch.out_cache_loc] = batch.positions
        rows = []
        for li in batch.logits_indices.tolist():
            r = int(batch.req_index[li])
            n = int(batch.seq_lens[r])
            slots = batch.slots_of(r, n)
            pos = self.kv_pos[slots]
            if not torch.equal(pos, torch.arange(n)):
                bad = int((pos != torch.arange(n)).nonzero()[0])
                raise AssertionError(f"row {r}: slot {int(slots[bad])} holds position {int(pos[bad])}, not {bad}")
            rows.append(fake_logits(self.kv_tok[slots].tolist(), self.cfg.vocab_size, self.eos_every))
        return torch.stack(rows) if rows else torch.zeros(0, self.cfg.vocab_size)


def prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """n printable-byte prompts of lo..hi tokens, reproducible from the seed."""
    r = random.Random(seed)
    return [[r.randrange(32, 127) for _ in range(r.randrange(lo, hi + 1))] for _ in range(n)]
