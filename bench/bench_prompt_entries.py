"""CPU cost of a long prompt's logprob entries, stage by stage, from the scheduler's message to the response body.

A completion with a 32K-token prompt and vLLM's `prompt_logprobs` = 20 (or echo + logprobs) carries ~690K
alternatives. This builds the engine-side entries as the scheduler sends them (`plps`: None, then
{"logprob", "rank", "top": [[id, logprob], ...]} per prompt token, float32 values as Python floats) and times each
stage on this CPU, median of `--repeat` runs: the scheduler's BATCH pack and the detokenizer's unpack, the
detokenizer's entries (Detokenizer.handle_batch), its OUTPUTS pack, the main process's unpack, and the response
(OpenAIServing's whole-response builders, then the body as _race renders it, starlette's JSONResponse; streamed:
the SSE chunks).

    python bench/bench_prompt_entries.py [--tokens 32768] [--k 20] [--vocab 154880] [--repeat 5]

`--vocab` past the built-in tokenizer's 6,144 ids gives the extra ids synthetic texts (the real GLM vocabulary has
154,880): what matters to the cost is how many distinct ids the alternatives name. The detokenizer's per-id memo is
warm after the first request of a process; the `entries (first request: cold memo)` row is the first request's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.server import ipc
from dsaserve.server.detokenizer_process import Detokenizer
from dsaserve.server.hf_tokenizer import HFTokenizer
from dsaserve.server.openai_serving import OpenAIServing
from dsaserve.server.request_state import GenerateRequest, Handle, Prompt

BUILTIN = Path(__file__).resolve().parents[1] / "dsaserve" / "builtin" / "glm-5.3-mini"


class WideTokenizer(HFTokenizer):
    """The built-in tokenizer, with ids past its vocabulary given distinct synthetic texts (a larger vocabulary)."""

    def token_bytes(self, token_id: int) -> bytes:
        if token_id < self.vocab_size:
            return super().token_bytes(token_id)
        return f" w{token_id}".encode()


def engine_plps(ids: list[int], k: int, vocab: int, rng: random.Random) -> list[dict | None]:
    """What the scheduler sends for a prompt: each token's logprob and rank and the top-k, Zipf-like ids (a real
    prompt's alternatives name far fewer distinct ids than the vocabulary), float32 values."""
    import numpy as np

    out: list[dict | None] = [None]
    for tid in ids[1:]:
        top_ids = _distinct_ids(rng, vocab, k)
        values = sorted((float(np.float32(-rng.expovariate(0.5))) for _ in top_ids), reverse=True)
        rank = rng.randrange(1, k + 1) if rng.random() < 0.6 and k else rng.randrange(k + 1, 5000)
        if rank <= k:
            top_ids[rank - 1] = tid if tid not in top_ids else top_ids[rank - 1]
            own = values[rank - 1]
        else:
            own = float(np.float32((values[-1] if values else 0.0) - rng.expovariate(1.0)))
        out.append({"logprob": own, "rank": rank, "top": [[t, v] for t, v in zip(top_ids, values, strict=True)]})
    return out


def _distinct_ids(rng: random.Random, vocab: int, k: int) -> list[int]:
    ids: dict[int, None] = {}
    while len(ids) < k:
        ids[_zipf_id(rng, vocab)] = None
    return list(ids)


def _zipf_id(rng: random.Random, vocab: int) -> int:
    return min(int(vocab ** rng.random()) - 1 + rng.randrange(2), vocab - 1)


def handle(rid: str, ids: list[int], item: dict[str, Any], k: int, echo_k: int | None, chat: bool) -> Handle:
    """A finished one-choice request whose single output carries the prompt entries."""
    s = SamplingParams(max_tokens=1, logprobs=echo_k, prompt_logprobs=max(k, echo_k or 0))
    req = GenerateRequest(rid, [Prompt(ids, "x" * len(ids))], s, 1, logprobs=echo_k is not None and not chat,
                          echo=echo_k is not None, prompt_logprobs=k if echo_k is None or k else None)
    h = Handle(req)
    h.register(rid, 0)
    h.open_samples.clear()
    h.queue.put_nowait((0, item))
    return h


def timeit(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, got = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        got = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--k", type=int, default=20)
    ap.add_argument("--echo-k", type=int, default=5, help="completions' logprobs with echo (at most 5)")
    ap.add_argument("--vocab", type=int, default=154880)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    rng = random.Random(0)
    tok = WideTokenizer(BUILTIN)
    ids = [_zipf_id(rng, a.vocab) for _ in range(a.tokens)]
    plps = engine_plps(ids, a.k, a.vocab, rng)
    reg = {"rid": "r", "n": 1, "prompt_tail": ids[-8:], "stop": [], "logprobs": False, "prompt_ids": ids}
    delta = {"rid": "r", "index": 0, "ids": [5], "lps": None, "finished": True, "reason": "length",
             "prompt_tokens": len(ids), "cached_tokens": 0, "plps": plps}
    distinct = len({t for e in plps[1:] for t, _ in e["top"]} | set(ids))
    print(f"prompt {a.tokens} tokens, top-{a.k}, vocabulary {a.vocab} ({distinct} distinct ids), "
          f"median of {a.repeat}")
    rows: dict[str, float] = {}

    def stage(name: str, fn: Callable[[], Any], repeat: int = a.repeat) -> Any:
        rows[name], got = timeit(fn, repeat)
        print(f"  {name:<64} {rows[name] * 1e3:8.1f} ms", flush=True)
        return got

    batch = stage("scheduler: pack BATCH", lambda: ipc.pack(ipc.BATCH, register=[reg], deltas=[delta], drop=[]))
    msg = stage("detokenizer: unpack BATCH", lambda: ipc.unpack(batch))
    stage("detokenizer: entries (first request: cold memo)", lambda: Detokenizer(tok).handle_batch(msg)[0], repeat=1)
    items = stage("detokenizer: entries", lambda: Detokenizer(tok).handle_batch(msg)[0])
    outputs = stage("detokenizer: pack OUTPUTS", lambda: ipc.pack(ipc.OUTPUTS, items=items))
    print(f"  ({len(batch) / 1e6:.1f} MB BATCH, {len(outputs) / 1e6:.1f} MB OUTPUTS)")
    item = stage("main: unpack OUTPUTS", lambda: ipc.unpack(outputs))["items"][0]
    shared = sum(rows[n] for n in ("detokenizer: unpack BATCH", "detokenizer: entries", "detokenizer: pack OUTPUTS",
                                   "main: unpack OUTPUTS"))
    loop = asyncio.new_event_loop()  # not asyncio.run: restoring its SIGINT handler reprs the task, result and all
    serving = OpenAIServing.__new__(OpenAIServing)
    serving.model_name, serving.tm = "m", _NoTM()
    cases = {f"completions prompt_logprobs={a.k}": (a.k, None, False),
             f"completions echo+logprobs={a.echo_k}": (0, a.echo_k, False),
             f"chat prompt_logprobs={a.k}": (a.k, None, True)}
    for name, (k, echo_k, chat) in cases.items():
        full = serving._chat_full if chat else serving._completion_full
        body = stage(f"main: {name}", lambda f=full, k=k, e=echo_k, c=chat:
                     loop.run_until_complete(f(handle("r", ids, item, k, e, c))))
        size = len(stage(f"main:   JSON body ({name})", lambda b=body: JSONResponse(b).body))
        print(f"  ({size / 1e6:.1f} MB body; detokenizer + main, whole: "
              f"{(shared + rows[f'main: {name}'] + rows[f'main:   JSON body ({name})']) * 1e3:.1f} ms)")
        if not chat:
            stage(f"main:   streamed: SSE chunks ({name})", lambda k=k, e=echo_k: loop.run_until_complete(
                _stream(serving, handle("r", ids, item, k, e, False))))


async def _stream(serving: OpenAIServing, h: Handle) -> int:
    return sum([len(c) async for c in serving._completion_stream(h)])


class _NoTM:
    async def abort(self, h: Handle) -> None:
        return None


if __name__ == "__main__":
    main()
