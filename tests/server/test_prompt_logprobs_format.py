"""Prompt logprobs' responses, byte for byte as before the columns: a random prompt's engine entries through the
detokenizer (columns, packed), IPC and the serving code, against the former implementation kept compact here (an
entry dict per prompt token, a list per alternative), for vLLM's prompt_logprobs and echo with logprobs, on
/v1/completions and /v1/chat/completions, whole and streamed."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from starlette.responses import JSONResponse

import dsaserve
from dsaserve.common.sampling_params import SamplingParams
from dsaserve.server import ipc
from dsaserve.server.detokenizer_process import Detokenizer, prompt_entries
from dsaserve.server.hf_tokenizer import HFTokenizer
from dsaserve.server.logprob_format import PromptEntries, TextOffsets, vllm_prompt_logprobs
from dsaserve.server.openai_serving import OpenAIServing, chunk_sse
from dsaserve.server.protocol import ChatCompletionChunk, ChatCompletionResponse, CompletionResponse
from dsaserve.server.request_state import GenerateRequest, Handle, Prompt

BUILTIN = Path(dsaserve.__file__).parent / "builtin" / "glm-5.3-mini"
# texts past the vocabulary: what JSON escapes, more than one byte, and bytes that are not whole UTF-8
CRAFTED = [b'"', b"\\", b"\n", b"\x00\x1f", b"\x7f", "\u2028".encode(), "é".encode(), "🤖".encode(), b"\xe4\xb8",
           b"", b"</s>"]
FLOATS = [-1e-05, -1.2e-05, -0.0, 0.0, -1e-07, -123.456, -3.4028234663852886e+38, -5e-324, -1e16, -0.1]


class CraftedTokenizer(HFTokenizer):
    """The built-in tokenizer with the CRAFTED texts, then synthetic ones, past its vocabulary."""

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < self.vocab_size:
            return super().token_bytes(token_id)
        i = token_id - self.vocab_size
        return CRAFTED[i] if i < len(CRAFTED) else f" w{token_id}".encode()


@pytest.fixture(scope="module")
def tok() -> CraftedTokenizer:
    return CraftedTokenizer(BUILTIN)


# ---- the former implementation ------------------------------------------------------------------------------
def old_prompt_entries(tok: HFTokenizer, ids: list[int], plps: list[dict | None]) -> list[dict]:
    out = []
    for tid, lp in zip(ids, plps, strict=True):
        text, raw = tok.token_strings(tid)
        e = {"id": tid, "token": text, "bytes": raw, "logprob": None, "rank": None, "top": None}
        if lp is not None:
            e.update(logprob=float(lp["logprob"]), rank=int(lp["rank"]),
                     top=[[tok.token_strings(int(t))[0], float(v), tok.token_strings(int(t))[1], int(t)]
                          for t, v in lp["top"]])
        out.append(e)
    return out


def old_echo(entries: list[dict], k: int) -> dict[str, list]:
    offsets, lp = TextOffsets(0), {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
    for e in entries:
        lp["tokens"].append(e["token"])
        lp["token_logprobs"].append(e["logprob"])
        lp["top_logprobs"].append(None if e["top"] is None else {t[0]: t[1] for t in e["top"][:k]})
        lp["text_offset"].append(offsets.take(e["bytes"]))
    return lp


def old_vllm(entries: list[dict], k: int) -> list:
    out: list = []
    for e in entries:
        if e["logprob"] is None:
            out.append(None)
            continue
        d = {str(e["id"]): {"logprob": e["logprob"], "rank": e["rank"], "decoded_token": e["token"]}}
        for rank, t in enumerate(e["top"][:k], start=1):
            d.setdefault(str(t[3]), {"logprob": t[1], "rank": rank, "decoded_token": t[0]})
        out.append(d)
    return out


# ---- a random prompt's engine entries -----------------------------------------------------------------------
def random_case(tok: HFTokenizer, rng: random.Random, n: int, k: int) -> tuple[list[int], list[dict | None]]:
    """Prompt ids and the scheduler's entries: the first None (and one more, mid-prompt), the token itself often
    among the alternatives, now and then an id twice or a shorter list, float32 values and FLOATS."""
    top_id = tok.vocab_size + len(CRAFTED) + 30
    ids = [rng.randrange(top_id) for _ in range(n)]
    plps: list[dict | None] = [None]
    for i in range(1, n):
        if i == n // 2:
            plps.append(None)
            continue
        top = rng.sample(range(top_id), k)
        if rng.random() < 0.5:
            top[rng.randrange(k)] = ids[i]
        if rng.random() < 0.05:
            top[-1] = top[0]
        if rng.random() < 0.03:
            top = top[:rng.randrange(k)]
        values = sorted((_value(rng) for _ in top), reverse=True)
        plps.append({"logprob": _value(rng), "rank": rng.randrange(1, 3 * k), "top": [[t, v] for t, v in
                                                                                     zip(top, values, strict=True)]})
    return ids, plps


def _value(rng: random.Random) -> float:
    if rng.random() < 0.1:
        return rng.choice(FLOATS)
    return struct.unpack("f", struct.pack("f", -rng.expovariate(0.3)))[0]  # a float32, as the engine's


# ---- the serving code, on one finished request ---------------------------------------------------------------
def serving_item(tok: HFTokenizer, ids: list[int], plps: list, index: int) -> dict[str, Any]:
    """The detokenizer's output for one sample that carries the prompt's entries, through IPC both ways."""
    reg = {"rid": "r", "n": 2, "prompt_tail": ids[-8:], "logprobs": True, "prompt_ids": ids}
    delta = {"rid": "r", "index": index, "ids": [5], "lps": [{"logprob": -0.5, "top": [[5, -0.5], [7, -1.25]]}],
             "finished": True, "reason": "length", "prompt_tokens": len(ids), "plps": plps}
    msg = ipc.unpack(ipc.pack(ipc.BATCH, register=[reg], deltas=[delta], drop=[]))
    items, _ = Detokenizer(tok).handle_batch(msg)
    return ipc.unpack(ipc.pack(ipc.OUTPUTS, items=items))["items"][0]


def handle(tok: HFTokenizer, ids: list[int], plps: list, k: int | None, echo_k: int | None, n: int = 1) -> Handle:
    s = SamplingParams(n=n, max_tokens=1, logprobs=echo_k, prompt_logprobs=max(k or 0, echo_k or 0))
    text = tok.decode(ids, skip_special_tokens=False)
    req = GenerateRequest("cmpl-x", [Prompt(ids, text)], s, 1, logprobs=echo_k is not None, echo=echo_k is not None,
                          prompt_logprobs=k)
    h = Handle(req)
    h.register("r", 0)
    h.open_samples.clear()
    for c in range(n):
        h.queue.put_nowait((c, serving_item(tok, ids, plps, c)))
    return h


class _NoTM:
    async def abort(self, h: Handle) -> None:
        return None


def serving() -> OpenAIServing:
    s = OpenAIServing.__new__(OpenAIServing)
    s.model_name, s.tm = "m", _NoTM()
    return s


def run(coro: Any) -> Any:
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def collect(stream: Any) -> list[str]:
    return [c async for c in stream]


# ---- expected: the former structures in the body the new code made (its other fields are not under test) ----
def expected_choice(c: dict, old: list[dict], k: int | None, echo_k: int | None, whole: bool = True) -> dict:
    c = dict(c)
    if k is not None and (whole or "prompt_logprobs" in c):  # a stream has them on a choice's first chunk only
        c["prompt_logprobs"] = old_vllm(old, k)
    if echo_k is not None and "logprobs" in c and len(c["logprobs"]["tokens"]) >= len(old):
        prefix = old_echo(old, echo_k)  # the prompt's part; the completion's, after it, is unchanged code's
        c["logprobs"] = {f: prefix[f] + c["logprobs"][f][len(old):] for f in prefix}
    return c


def expected_body(body: bytes, model: type, old: list[dict], k: int | None, echo_k: int | None) -> bytes:
    got = json.loads(body)
    if "choices" in got and model is CompletionResponse:
        got["choices"] = [expected_choice(c, old, k, echo_k) for c in got["choices"]]
    elif k is not None:
        got["prompt_logprobs"] = old_vllm(old, k)
    return JSONResponse(model.model_validate(got).model_dump(exclude_none=True)).body


def expected_chunk(chunk: str, model: type, old: list[dict], k: int | None, echo_k: int | None) -> str:
    if chunk == "data: [DONE]\n\n":
        return chunk
    got = json.loads(chunk[len("data: "):])
    if model is CompletionResponse:
        got["choices"] = [expected_choice(c, old, k, echo_k, whole=False) for c in got["choices"]]
    elif "prompt_logprobs" in got:
        got["prompt_logprobs"] = old_vllm(old, k)
    return chunk_sse(model.model_validate(got))


CASES = [(20, None, 1), (3, None, 1), (0, None, 1), (None, 4, 1), (2, 5, 1), (6, 1, 2), (4, None, 2)]


@pytest.mark.parametrize(("k", "echo_k", "n"), CASES)
def test_completions_bodies_and_chunks_are_the_former_bytes(tok, k, echo_k, n):
    rng = random.Random(f"{k}-{echo_k}-{n}")
    ids, plps = random_case(tok, rng, 300, 8)
    old = old_prompt_entries(tok, ids, plps)
    body = JSONResponse(run(serving()._completion_full(handle(tok, ids, plps, k, echo_k, n)))).body
    assert body == expected_body(body, CompletionResponse, old, k, echo_k)
    chunks = run(collect(serving()._completion_stream(handle(tok, ids, plps, k, echo_k, n))))
    assert any("prompt_logprobs" in c or "logprobs" in c for c in chunks)
    for c in chunks:
        assert c == expected_chunk(c, CompletionResponse, old, k, echo_k)


@pytest.mark.parametrize(("k", "n"), [(20, 1), (1, 2), (0, 1)])
def test_chat_bodies_and_chunks_are_the_former_bytes(tok, k, n):
    rng = random.Random(f"chat-{k}-{n}")
    ids, plps = random_case(tok, rng, 200, 6)
    old = old_prompt_entries(tok, ids, plps)
    h = handle(tok, ids, plps, k, None, n)
    body = JSONResponse(run(serving()._chat_full(h))).body
    assert b'"prompt_logprobs":[null,{' in body
    assert body == expected_body(body, ChatCompletionResponse, old, k, None)
    chunks = run(collect(serving()._chat_stream(handle(tok, ids, plps, k, None, n))))
    assert sum('"prompt_logprobs":[null' in c for c in chunks) == 1
    for c in chunks:
        assert c == expected_chunk(c, ChatCompletionChunk, old, k, None)


def test_a_value_that_is_not_finite_fails_the_body_and_streams_as_before(tok):
    """No JSON for inf: the whole body is a ValueError (JSONResponse's); a chunk writes it null (pydantic)."""
    ids, plps = random_case(tok, random.Random(7), 40, 4)
    plps[1]["logprob"] = float("-inf")  # the token's own: always written
    old = old_prompt_entries(tok, ids, plps)
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        JSONResponse(run(serving()._completion_full(handle(tok, ids, plps, 4, None))))
    chunks = run(collect(serving()._completion_stream(handle(tok, ids, plps, 4, None))))
    assert any('"logprob":null' in c for c in chunks)
    for c in chunks:
        assert c == expected_chunk(c, CompletionResponse, old, 4, None)


def test_vllm_prompt_logprobs_of_the_columns_are_the_former_on_any_lists(tok):
    """Shorter lists, None mid-prompt, ids twice, k past the lists, for a large random case."""
    ids, plps = random_case(tok, random.Random(3), 3000, 12)
    old = old_prompt_entries(tok, ids, plps)
    e = PromptEntries.from_wire(ipc.unpack(ipc.pack("x", e=prompt_entries(tok, ids, plps)))["e"])
    for k in (0, 1, 5, 12, 30):
        assert vllm_prompt_logprobs(e, k) == old_vllm(old, k)


def test_packed_numbers_cross_exactly_and_unpack_leaves_the_collector_as_it_was():
    values = [0, -1, 2**62, 154879]
    floats = [-0.0, 5e-324, -1e-05, float("-inf"), 1.7976931348623157e308]
    msg = ipc.unpack(ipc.pack("x", i=ipc.pack_ints(values), f=ipc.pack_floats(floats), big=[[1.5]] * 100_000))
    assert ipc.unpack_ints(msg["i"]) == values and ipc.unpack_floats(msg["f"]) == floats
    assert gc.isenabled()
    gc.disable()
    try:
        ipc.unpack(ipc.pack("x", big=[[1.5]] * 100_000))
        assert not gc.isenabled()
    finally:
        gc.enable()
