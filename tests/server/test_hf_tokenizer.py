"""The server's tokenizer without transformers: chat templates render exactly as transformers renders
them, template errors are clean ValueErrors, and logprob token bytes are exact."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from dsaserve.server.hf_tokenizer import ChatTemplateError, HFTokenizer
from tests.server.harness import MODEL

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve café — 北京 🤖"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again?"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]}],
    [{"role": "user", "content": "call it"}, {"role": "tool", "content": "{\"ok\": true}"}],
]


@pytest.fixture(scope="module")
def hf(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(str(tiny_checkpoint(MODEL)))


@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_chat_template_renders_like_transformers(tokenizer, hf, conv, gen):
    msgs = CONVERSATIONS[conv]
    ours = tokenizer.apply_chat_template(msgs, add_generation_prompt=gen)
    assert ours == hf.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)
    assert tokenizer.encode(ours, add_special_tokens=False) == hf.encode(ours, add_special_tokens=False)


def test_template_exceptions_and_missing_templates_are_clean_errors(tokenizer, tmp_path, tiny_checkpoint):
    with pytest.raises(ChatTemplateError, match="unknown message role"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}])
    src = tiny_checkpoint(MODEL)
    (tmp_path / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])


def test_transformers_template_extras_work(tokenizer, tmp_path, tiny_checkpoint):
    """`{% generation %}`, `tojson` without HTML escaping, loop controls, special-token variables."""
    src = tiny_checkpoint(MODEL)
    (tmp_path / "tokenizer.json").write_text((src / "tokenizer.json").read_text())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
                            "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    msgs = [{"role": "user", "content": "<a & b>"}, {"role": "assistant", "content": "é"},
            {"role": "user", "content": "dropped"}]
    out = HFTokenizer(tmp_path).apply_chat_template(msgs)
    assert out == '[gMASK]{"role": "user", "content": "<a & b>"}{"role": "assistant", "content": "é"}'


def test_token_bytes_are_exact_even_for_half_characters(tokenizer):
    text = "北京 🤖 café"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == text.encode()
    halves = [t for t in ids if tokenizer.token_text(t).startswith("bytes:")]
    assert halves  # the byte-level tokenizer splits some of these characters
    for t in halves:
        assert tokenizer.token_text(t) == "bytes:" + "".join(f"\\x{b:02x}" for b in tokenizer.token_bytes(t))


def test_no_token_covers_more_bytes_than_max_token_bytes(tokenizer):
    """The door's byte bound (server/processor.py) relies on it: B bytes of text are >= B / max tokens."""
    texts = ["Hello world", " " * 500, "=" * 300 + "\n" * 40, "naïve café 日本語 😀" * 20, "abc" * 1000]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) * tokenizer.max_token_bytes >= len(text.encode("utf-8")), text[:20]
    assert tokenizer.max_token_bytes == max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
