"""Detokenizer process: token ids -> text, stop strings (request path stage 10).

Owns: the process loop — take the scheduler's batches (register / deltas / drop), keep one text state per
live sample, send text outputs to the main process, and tell the scheduler to abort a sample whose stop
string matched (the scheduler does not know text, only ids) — and the logprob entries (token text and
bytes). The text work itself (incremental decoding in context, stop strings with hold-back,
include_stop_str_in_output, skip_special_tokens) is engine/incremental_detokenizer.py's IncrementalDetokenizer, the
same class the offline Engine uses, so both fronts give the same text for the same ids. Its ready report
carries its own start-up: `detokenizer_spawn` (the launcher's Popen -> this module's first line),
`detokenizer_imports` and `detokenizer_tokenizer`.
"""

# ruff: noqa: E402 -- the clock is read before any import: the process reports its own import time
from __future__ import annotations

import time

FIRST_LINE = time.time()

import json
import sys
import traceback
from itertools import chain
from typing import Any

import zmq

from dsaserve.engine.incremental_detokenizer import IncrementalDetokenizer
from dsaserve.engine.lifetime import start_child
from dsaserve.errors import CheckpointError
from dsaserve.server import ipc
from dsaserve.server.hf_tokenizer import HFTokenizer
from dsaserve.server.startup_clock import child_phases


def logprob_entries(tok: HFTokenizer, ids: list[int], lps: list[dict]) -> list[dict]:
    """Engine logprobs ({"logprob", "top": [[id, logprob], ...]} per token) with the token text and bytes:
    {id, token, bytes, logprob, top: [[token, logprob, bytes, id], ...]}."""
    out = []
    for tid, lp in zip(ids, lps, strict=False):
        text, raw = tok.token_strings(tid)
        out.append({"id": tid, "token": text, "bytes": raw, "logprob": float(lp["logprob"]),
                    "top": [_alternative(tok, t, v) for t, v in lp.get("top", [])]})
    return out


def prompt_entries(tok: HFTokenizer, ids: list[int], plps: list[dict | None]) -> dict[str, Any]:
    """Engine prompt logprobs (None for the first token, else {"logprob", "rank", "top": [[id, logprob], ...]}) with
    each prompt token's text and bytes, as columns (logprob_format.PromptEntries reads them): per prompt token
    `logprob`, `rank` (None for the first) and `top_len`, its alternatives' count; `top_ids` / `top_lps`, every
    alternative in position order, packed (ipc.pack_ints, ipc.pack_floats); `ids` and `bytes` of the prompt's tokens;
    `vocab` / `text`, the token text of each id named.

    Columns, not a dict per token and a list per alternative: a 32K-token prompt's top-20 is 690K alternatives, and
    that many small containers took ~1 s here and as much again to pack and unpack (most of it the garbage
    collector's passes over them); packed, the 690K numbers cross as two byte strings."""
    if len(ids) != len(plps):
        raise ValueError(f"prompt logprobs: {len(plps)} entries for {len(ids)} prompt tokens")
    pairs = list(chain.from_iterable(chain.from_iterable(lp["top"] for lp in plps if lp is not None)))
    top_ids = pairs[0::2]  # pairs: id, logprob, id, logprob, ...
    vocab = list(set(top_ids).union(ids))
    return {"ids": ids, "bytes": [bytes(tok.token_strings(t)[1]) for t in ids],
            "logprob": [None if lp is None else float(lp["logprob"]) for lp in plps],
            "rank": [None if lp is None else int(lp["rank"]) for lp in plps],
            "top_len": [0 if lp is None else len(lp["top"]) for lp in plps],
            "top_ids": ipc.pack_ints(top_ids), "top_lps": ipc.pack_floats(pairs[1::2]),
            "vocab": vocab, "text": tok.token_texts(vocab)}


def _alternative(tok: HFTokenizer, tid: int, logprob: float) -> list:
    """[token, logprob, bytes, id]: one top alternative of a logprob entry."""
    text, raw = tok.token_strings(int(tid))
    return [text, float(logprob), raw, int(tid)]


class Detokenizer:
    """All live requests of one server; turns a scheduler batch into outputs (and stop aborts).

    A request with n samples has one state per sample index, made on its first delta. A stop string ends
    only its own sample: the abort names the sample index, and the core aborts just that sample (the
    others keep the prompt pages they share with it).
    """

    def __init__(self, tok: HFTokenizer) -> None:
        self.tok = tok
        self.meta: dict[str, dict[str, Any]] = {}  # rid -> register message
        self.live: dict[tuple[str, int], IncrementalDetokenizer] = {}
        self.done: dict[str, set[int]] = {}  # rid -> sample indices already finished

    def register(self, reg: dict[str, Any]) -> None:
        self.meta[reg["rid"]] = reg
        self.done[reg["rid"]] = set()

    def drop(self, rid: str) -> None:
        reg = self.meta.pop(rid, None)
        self.done.pop(rid, None)
        for i in range(reg.get("n", 1) if reg else 0):
            self.live.pop((rid, i), None)

    def _state(self, rid: str, index: int) -> IncrementalDetokenizer | None:
        reg = self.meta.get(rid)
        if reg is None or index in self.done[rid]:  # aborted, or finished by a stop string: drop late deltas
            return None
        key = (rid, index)
        if key not in self.live:
            self.live[key] = IncrementalDetokenizer(self.tok, reg.get("prompt_tail", []), reg.get("stop") or (),
                                                    reg.get("include_stop_str_in_output", False),
                                                    reg.get("skip_special_tokens", True))
        return self.live[key]

    def process(self, delta: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """One engine TokenDelta -> (output item or None, whether the scheduler must abort this sample)."""
        rid, index = delta["rid"], delta.get("index", 0)
        state = self._state(rid, index)
        if state is None:
            return None, False
        ids: list[int] = list(delta.get("ids") or [])
        lps = delta.get("lps")
        engine_done = bool(delta.get("finished"))
        before = state.num_tokens
        # the core finishes with "stop" only on a stop token (EOS / stop_token_ids), the delta's last id
        hit = state.add(ids, final=engine_done, stop_terminated=engine_done and delta.get("reason") == "stop")
        used = state.num_tokens - before  # ids after the one that completed a stop string are not reported
        stopped = hit is not None
        finished = stopped or engine_done
        reg = self.meta[rid]
        item = {
            "rid": rid, "index": index, "text": state.delta(finished), "ids": ids[:used],
            "lps": logprob_entries(self.tok, ids[:used], lps[:used]) if lps and reg.get("logprobs") else None,
            "finished": finished, "reason": "stop" if stopped else delta.get("reason"),
            "stop_str": state.stop_string, "prompt_tokens": delta.get("prompt_tokens", 0),
            "cached_tokens": delta.get("cached_tokens", 0), "completion_tokens": state.num_tokens,
        }
        if delta.get("plps") is not None and "prompt_ids" in reg:
            item["plps"] = prompt_entries(self.tok, reg["prompt_ids"], delta["plps"])
        abort = stopped and not engine_done
        if finished:
            self.live.pop((rid, index), None)
            self.done[rid].add(index)
            if len(self.done[rid]) >= reg.get("n", 1):
                self.drop(rid)
        return item, abort

    def handle_batch(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], list[tuple[str, int]]]:
        """A scheduler batch -> (output items, (rid, sample index) of every sample to abort)."""
        for reg in msg.get("register", []):
            self.register(reg)
        items, aborts = [], []
        for delta in msg.get("deltas", []):
            item, abort = self.process(delta)
            if item is not None:
                items.append(item)
            if abort:
                aborts.append((delta["rid"], delta.get("index", 0)))
        for rid in msg.get("drop", []):
            self.drop(rid)
        return items, aborts


def run(cfg: dict[str, Any]) -> None:
    t_start = time.time()
    log = start_child("detokenizer", cfg)
    ends = ipc.Endpoints(**cfg["endpoints"])
    ctx = zmq.Context()
    pull = ipc.pull_socket(ctx, ends.detok_in)
    to_main = ipc.push_socket(ctx, ends.main_in)
    to_sched = ipc.push_socket(ctx, ends.sched_in)
    try:
        t_tok = time.time()
        detok = Detokenizer(HFTokenizer(cfg["model_dir"]))
    except CheckpointError as e:  # the tokenizer file missing or broken: one line naming it, no traceback
        to_main.send(ipc.pack(ipc.FATAL, who="detokenizer", message=str(e), cause="checkpoint"))
        log.error("%s", e)
        time.sleep(0.2)  # let the message leave before the process (and its socket) goes away
        sys.exit(1)
    except Exception as e:
        to_main.send(ipc.pack(ipc.FATAL, who="detokenizer", message=f"{type(e).__name__}: {e}"))
        raise
    phases = {**child_phases("detokenizer", cfg.get("spawn_time"), FIRST_LINE, t_start),
              "detokenizer_tokenizer": round(time.time() - t_tok, 4)}
    to_main.send(ipc.pack(ipc.READY, who="detokenizer", info={"startup_time": phases}))
    log.info("ready")
    try:
        while True:
            for msg in ipc.drain(pull, 1000):
                if msg["t"] != ipc.BATCH:
                    continue
                items, aborts = detok.handle_batch(msg)
                for rid, index in aborts:
                    to_sched.send(ipc.pack(ipc.ABORT, rid=rid, index=index))
                if items:
                    to_main.send(ipc.pack(ipc.OUTPUTS, items=items))
    except Exception:
        to_main.send(ipc.pack(ipc.FATAL, who="detokenizer", message=traceback.format_exc()[-2000:]))
        raise


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
