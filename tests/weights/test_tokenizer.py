"""The built-in byte-level BPE tokenizer: fixed special ids, HF loading + chat template, UTF-8 round trip."""

import dataclasses
import random

import pytest
from transformers import AutoTokenizer

from dsaserve.config import load_config
from dsaserve.weights.tokenizer_builder import SPECIAL_TOKENS, build_tokenizer, write_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer(load_config("glm-5.3-tiny"), d)
    return d


@pytest.fixture(scope="module")
def hf(tok_dir):
    return AutoTokenizer.from_pretrained(str(tok_dir))


def _random_texts(n=40, seed=0):
    """Mixed scripts, emoji, combining marks, control characters, astral planes (no surrogates)."""
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x4E00, 0x9FFF),
              (0x3040, 0x30FF), (0x0300, 0x036F), (0x1F300, 0x1FAFF), (0x10000, 0x10FFF), (0xE000, 0xF8FF)]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 60)):
            lo, hi = rng.choice(ranges)
            chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    return out + ["", " ", "  leading and trailing  ", "tab\tnew\nline\r\n", "naïve café — 北京 🤖👍🏽"]


def test_special_tokens_have_fixed_ids_and_eos_matches_the_config():
    cfg = load_config("glm-5.3-tiny")
    tok = build_tokenizer(cfg)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.token_to_id("[gMASK]") == cfg.bos_token_id == 0
    assert tok.token_to_id("<|endoftext|>") == cfg.eos_token_id[0] == 1
    assert tok.get_vocab_size() == min(cfg.vocab_size, 512)


def test_vocab_never_exceeds_the_model_vocab():
    cfg = dataclasses.replace(load_config("glm-5.3-tiny"), vocab_size=300)
    assert build_tokenizer(cfg).get_vocab_size() == 300


def test_auto_tokenizer_loads_it_with_special_tokens(hf):
    assert (hf.bos_token, hf.eos_token, hf.pad_token) == ("[gMASK]", "<|endoftext|>", "<|endoftext|>")
    assert (hf.bos_token_id, hf.eos_token_id) == (0, 1)
    assert len(hf) == 512
    # special tokens inside text are single ids, never split into bytes
    assert hf.encode("<|user|>hi<|assistant|>", add_special_tokens=False)[0] == 4
    assert hf.encode("<|user|>hi<|assistant|>", add_special_tokens=False)[-1] == 5


def test_chat_template_is_glm5_style(hf):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi."},
                {"role": "tool", "content": [{"type": "text", "text": "42"}]}]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("[gMASK]<sop><|system|>Be brief.<|user|>Hello<|assistant|></think>Hi."
                    "<|observation|><tool_response>42</tool_response><|assistant|><think>")
    no_prompt = hf.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert no_prompt == "[gMASK]<sop><|system|>Be brief.<|user|>Hello"
    off = hf.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == "[gMASK]<sop><|user|>Hello<|assistant|></think>"
    ids = hf.apply_chat_template(messages[1:2], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[:3] == [0, 2, 4] and ids[-2] == 5  # [gMASK] <sop> <|user|> ... <|assistant|> <think>
    assert ids[-1] == hf.convert_tokens_to_ids("<think>")
    assert hf.decode(ids) == "[gMASK]<sop><|user|>Hello<|assistant|><think>"


def test_think_and_tool_tokens_are_single_ids_kept_by_skip_special_tokens(hf):
    for t in ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "<arg_value>", "</arg_value>"):
        ids = hf.encode(t, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] < 512
        assert hf.decode(ids, skip_special_tokens=True) == t


def test_deepseek_v32_tokenizer_has_its_own_special_tokens_and_no_jinja_template(tmp_path):
    cfg = load_config("deepseek-v3.2-tiny")
    write_tokenizer(cfg, tmp_path)
    ds = AutoTokenizer.from_pretrained(str(tmp_path))
    assert (ds.bos_token, ds.eos_token) == ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
    assert (ds.bos_token_id, ds.eos_token_id) == (0, 1) and len(ds) == 512
    assert len(ds.encode("<｜User｜>", add_special_tokens=False)) == 1
    assert len(ds.encode("</think>", add_special_tokens=False)) == 1
    assert ds.chat_template is None  # encoded in Python (server/chat_encoding/deepseek_v32.py), as the real one


def test_chat_template_rejects_an_unknown_role(hf):
    with pytest.raises(Exception, match="unknown message role wizard"):
        hf.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=False)


def test_decode_round_trips_arbitrary_utf8(hf, tok_dir):
    tok = build_tokenizer(load_config("glm-5.3-tiny"))
    for text in _random_texts():
        ids = tok.encode(text).ids
        assert tok.decode(ids) == text
        assert hf.decode(hf.encode(text, add_special_tokens=False)) == text
    # merges really compress English (the BPE was trained, not just bytes)
    sentence = "The scheduler picks the requests for the next step of the model."
    assert len(tok.encode(sentence).ids) < 0.5 * len(sentence.encode())


def test_tokenizer_files_are_identical_every_time(tmp_path, tok_dir):
    write_tokenizer(load_config("glm-5.3-tiny"), tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (tok_dir / name).read_bytes(), name


def test_ids_that_cannot_match_the_tokenizer_are_named():
    cfg = load_config("glm-5.3-tiny")
    with pytest.raises(ValueError, match="eos_token_id.*id 1.*5"):
        build_tokenizer(dataclasses.replace(cfg, eos_token_id=(5,)))
    with pytest.raises(ValueError, match="bos_token_id"):
        build_tokenizer(dataclasses.replace(cfg, bos_token_id=3))
    with pytest.raises(ValueError, match="vocab_size: 100"):
        build_tokenizer(dataclasses.replace(cfg, vocab_size=100))
    # a large model's eos id lies past the small tokenizer's vocab: allowed, the tokenizer keeps id 1
    slice_cfg = load_config("glm-5.3-slice")
    assert slice_cfg.eos_token_id[0] >= 512
    assert build_tokenizer(slice_cfg).token_to_id("<|endoftext|>") == 1
