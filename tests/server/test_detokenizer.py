"""Detokenizer: incremental text equals a full decode, stop strings cut (and never leak while streaming),
the process-level batch handling (register / deltas / drop, a stop string aborts only its own sample),
and the offline Engine and the server's detokenizer process giving the same text for the same ids."""

from __future__ import annotations

import random

import torch

from dsaserve import Engine, SamplingParams
from dsaserve.engine.incremental_detokenizer import IncrementalDetokenizer
from dsaserve.server.detokenizer_process import Detokenizer
from tests.engine.fake_runner import FakeRunner

TEXT = "Hello, world! naïve café — 北京 🤖👍🏽 done."


def _stream(tok, ids, **kw) -> tuple[IncrementalDetokenizer, list[str]]:
    d = IncrementalDetokenizer(tok, [0], **kw)
    pieces = []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        stopped = d.add([t], final=last) is not None
        pieces.append(d.delta(last or stopped))
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
    assert d.stop_string == "world!" and d.text == "Hello, "
    assert d.num_tokens == ids.index(tokenizer.encode("!")[0]) + 1  # consumed up to the token completing it
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
    assert d.stop_string == "Hello, w" and d.text == ""


def test_a_stop_token_has_no_text_unless_include_stop_str(tokenizer):
    ids = tokenizer.encode("Hello, world")
    for keep in (False, True):
        d = IncrementalDetokenizer(tokenizer, [0], include_stop_str_in_output=keep)
        d.add(ids[:-1])
        d.add(ids[-1:], final=True, stop_terminated=True)
        assert d.delta(True) == tokenizer.decode(ids if keep else ids[:-1]) and d.num_tokens == len(ids)


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
    assert aborts == [("a", 0), ("b", 1)]  # only the sample whose stop string matched is aborted
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


class ScriptedRunner(FakeRunner):
    """The fake runner with a real tokenizer, emitting a fixed list of ids (greedy, one per step)."""

    def __init__(self, tokenizer, prompt_len: int, script: list[int]) -> None:
        super().__init__()
        self.cfg.vocab_size = tokenizer.vocab_size
        self.tokenizer, self.prompt_len, self.script = tokenizer, prompt_len, script

    def forward(self, batch) -> torch.Tensor:
        rows = []
        for li in batch.logits_indices.tolist():
            logits = torch.zeros(self.cfg.vocab_size)
            logits[self.script[int(batch.seq_lens[int(batch.req_index[li])]) - self.prompt_len]] = 1.0
            rows.append(logits)
        return torch.stack(rows)


def _offline(tokenizer, prompt: list[int], ids: list[int], stop: list[str]) -> tuple[list[str], str, str, int]:
    eng = Engine(runner=ScriptedRunner(tokenizer, len(prompt), ids))
    params = SamplingParams(temperature=0, max_tokens=len(ids), ignore_eos=True, stop=stop)
    deltas, out = [], None
    for o in eng.stream(prompt, params):  # one cumulative output, updated in place: take each delta as it comes
        out = o.outputs[0]
        deltas.append(out.delta_text)
    eng.core.check_no_leak()
    return deltas, out.text, out.finish_reason, len(out.token_ids)


def _served(tokenizer, prompt: list[int], ids: list[int], stop: list[str]) -> tuple[list[str], str, str, int]:
    det = Detokenizer(tokenizer)
    det.register({"rid": "r", "n": 1, "prompt_tail": prompt, "stop": stop})
    deltas, text, reason, count = [], "", None, 0
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        items, _ = det.handle_batch({"deltas": [{"rid": "r", "index": 0, "ids": [t], "finished": last,
                                                 "reason": "length" if last else None}]})
        deltas.append(items[0]["text"])
        text, reason, count = text + items[0]["text"], items[0]["reason"], items[0]["completion_tokens"]
        if items[0]["finished"]:
            break
    return deltas, text, reason, count


def test_offline_engine_and_server_detokenizer_give_the_same_text_and_deltas(tokenizer):
    prompt = tokenizer.encode("The scheduler")
    ids = tokenizer.encode(TEXT)
    assert any(tokenizer.token_text(t).startswith("bytes:") for t in ids)  # multi-byte chars split over ids
    for stop in ([], ["京 🤖"], ["world!", "@@"]):  # none; a stop string over ids of split characters; ASCII
        offline, served = _offline(tokenizer, prompt, ids, stop), _served(tokenizer, prompt, ids, stop)
        assert offline == served
        deltas, text, reason, _ = offline
        assert "".join(deltas) == text
        full = tokenizer.decode(ids)
        if stop:
            assert reason == "stop" and text == full[: full.index(stop[0])] and stop[0][0] not in "".join(deltas)
        else:
            assert reason == "length" and text == full
