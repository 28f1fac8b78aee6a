"""Detokenizer: incremental text equals a full decode, stop strings cut (and never leak while streaming),
and the process-level batch handling (register / deltas / drop, aborts only for n == 1)."""

from __future__ import annotations

import random

from dsaserve.server.detokenizer import Detokenizer, RequestDetokenizer

TEXT = "Hello, world! naïve café — 北京 🤖👍🏽 done."


def _stream(tok, ids, **kw) -> tuple[RequestDetokenizer, list[str]]:
    d = RequestDetokenizer(tok, [0], **kw)
    pieces = []
    for i, t in enumerate(ids):
        stopped = d.feed(t)
        last = stopped or i == len(ids) - 1
        if last:
            d.finish()
        pieces.append(d.take(last))
        if stopped:
            break
    return d, pieces


def test_incremental_text_equals_the_full_decode_and_never_shows_half_characters(tokenizer):
    ids = tokenizer.encode(TEXT)
    d, pieces = _stream(tokenizer, ids)
    assert "".join(pieces) == TEXT == d.text
    assert not any("\ufffd" in p for p in pieces)  # multi-byte characters only come out whole


def test_random_ids_decode_like_the_tokenizer(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(7, tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))]
        _, pieces = _stream(tokenizer, ids)
        assert "".join(pieces) == tokenizer.decode(ids)


def test_stop_string_spanning_tokens_cuts_the_text_and_never_leaks(tokenizer):
    ids = tokenizer.encode(TEXT)
    d, pieces = _stream(tokenizer, ids, stop=["world!"])
    assert d.stopped_by == "world!" and d.text == "Hello, "
    assert "".join(pieces) == "Hello, "
    running = ""
    for p in pieces:  # at no point did a prefix of the stop string go out
        running += p
        assert "w" not in running


def test_include_stop_str_keeps_it_and_holds_nothing_back(tokenizer):
    ids = tokenizer.encode(TEXT)
    d, pieces = _stream(tokenizer, ids, stop=["world!"], include_stop_str_in_output=True)
    assert "".join(pieces) == "Hello, world!"
    assert d.hold == 0


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    d, _ = _stream(tokenizer, tokenizer.encode(TEXT), stop=["done", "café", "Hello, w"])
    assert d.stopped_by == "Hello, w" and d.text == ""


def test_batches_register_decode_stop_and_drop(tokenizer):
    det = Detokenizer(tokenizer)
    ids = tokenizer.encode(TEXT)
    reg = [{"rid": "a", "n": 1, "prompt_tail": [0], "stop": ["world"], "logprobs": True},
           {"rid": "b", "n": 2, "prompt_tail": [0], "stop": ["world"]},
           {"rid": "c", "n": 1, "prompt_tail": [0]}]
    lps = [{"logprob": -0.5, "top": [[t, -0.5], [7, -1.0]]} for t in ids]
    deltas = [{"rid": "a", "index": 0, "ids": ids, "lps": lps, "finished": False, "prompt_tokens": 1},
              {"rid": "b", "index": 1, "ids": ids, "finished": False},
              {"rid": "c", "index": 0, "ids": ids[:3], "finished": False}]
    items, aborts = det.handle_batch({"register": reg, "deltas": deltas, "drop": []})
    assert aborts == ["a"]  # n == 1: the scheduler must stop generating; n == 2 ("b") must not be aborted
    by = {(i["rid"], i["index"]): i for i in items}
    assert by[("a", 0)]["finished"] and by[("a", 0)]["reason"] == "stop" and by[("a", 0)]["text"] == "Hello, "
    used = by[("a", 0)]["ids"]
    assert len(by[("a", 0)]["lps"]) == len(used) < len(ids)  # tokens after the stop are not reported
    assert by[("a", 0)]["lps"][0]["bytes"] == list(tokenizer.token_bytes(ids[0]))
    assert by[("b", 1)]["finished"] and by[("b", 1)]["lps"] is None
    assert not by[("c", 0)]["finished"] and by[("c", 0)]["completion_tokens"] == 3
    late = [{"rid": "a", "index": 0, "ids": [], "finished": True, "reason": "abort"},
            {"rid": "b", "index": 1, "ids": [9], "finished": False},
            {"rid": "b", "index": 0, "ids": ids[:2], "finished": False}]
    items, aborts = det.handle_batch({"deltas": late, "drop": ["c"]})
    assert [(i["rid"], i["index"]) for i in items] == [("b", 0)] and aborts == []
    assert ("c", 0) not in det.live and "c" not in det.meta
    items, _ = det.handle_batch({"deltas": [{"rid": "c", "index": 0, "ids": [5], "finished": True}]})
    assert items == []  # a dropped request's late delta is ignored
