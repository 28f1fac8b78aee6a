"""Detokenizer process: token ids -> text, stop strings (request path stage 10).

Owns: one `RequestDetokenizer` per live request (incremental decoding with the `tokenizers` library's
DecodeStream, seeded with the prompt's last ids so the first output token decodes in context), stop
string matching on the decoded text, and the process loop: take the scheduler's batches (register /
deltas / drop), send text outputs to the main process, and tell the scheduler to abort a request whose
stop string matched (the scheduler does not know text, only ids).

Streaming never shows the start of a stop string that is about to match: up to `longest stop - 1`
characters are held back until they either complete a stop string (and are dropped) or can't (and are
sent), as vLLM does. With `include_stop_str_in_output` the stop string itself is sent.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import zmq
from tokenizers.decoders import DecodeStream

from dsaserve.server import ipc
from dsaserve.server.hf_tokenizer import HFTokenizer
from dsaserve.server.lifetime import die_with_parent, setup_child_logging

PROMPT_CONTEXT_IDS = 8  # prompt ids that seed DecodeStream: enough context for any merge at the boundary


class RequestDetokenizer:
    """Text state of one request: what was decoded, what was sent, whether a stop string matched."""

    def __init__(self, tok: HFTokenizer, prompt_tail: list[int], stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True) -> None:
        self.tok = tok
        self.stream = DecodeStream(ids=list(prompt_tail[-PROMPT_CONTEXT_IDS:]),
                                   skip_special_tokens=skip_special_tokens)
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in (stop or []) if s]
        self.include_stop = include_stop_str_in_output
        # a stop string may start this many characters before the newest piece
        self.lookback = max((len(s) for s in self.stop), default=1) - 1
        # with the stop string kept in the output nothing is ever cut, so nothing needs holding back
        self.hold = 0 if include_stop_str_in_output else self.lookback
        self.text = ""  # decoded so far (cut at a matched stop string)
        self.sent = 0  # characters of `text` already handed out
        self.output_ids: list[int] = []
        self.stopped_by: str | None = None

    def feed(self, token_id: int) -> bool:
        """Decode one more token; True when a stop string matched (the request is then finished)."""
        self.output_ids.append(token_id)
        piece = self.stream.step(self.tok.tokenizer, token_id)
        if not piece:
            return False
        start = max(0, len(self.text) - self.lookback)
        self.text += piece
        return self._match_stop(start)

    def _match_stop(self, start: int) -> bool:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        i, s = min(hits)  # the earliest match wins, as in vLLM
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stopped_by = s
        return True

    def finish(self) -> None:
        """End of generation: recover bytes DecodeStream still buffers (an incomplete UTF-8 tail)."""
        if self.stopped_by is not None:
            return
        full = self.tok.decode(self.output_ids, skip_special_tokens=self.skip_special_tokens)
        if len(full) > len(self.text) and full.startswith(self.text):
            self.text = full

    def take(self, finished: bool) -> str:
        """New text to send: everything on finish, else all but the held-back tail."""
        end = len(self.text) if finished or self.stopped_by is not None else max(self.sent, len(self.text) - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out


def logprob_entries(tok: HFTokenizer, ids: list[int], lps: list[dict]) -> list[dict]:
    """Engine logprobs ({"logprob", "top": [[id, logprob], ...]} per token) with the token text and bytes:
    {id, token, bytes, logprob, top: [[token, logprob, bytes], ...]}."""
    out = []
    for tid, lp in zip(ids, lps, strict=False):
        top = [[tok.token_text(int(t)), float(v), list(tok.token_bytes(int(t)))] for t, v in lp.get("top", [])]
        out.append({"id": tid, "token": tok.token_text(tid), "bytes": list(tok.token_bytes(tid)),
                    "logprob": float(lp["logprob"]), "top": top})
    return out


class Detokenizer:
    """All live requests of one server; turns a scheduler batch into outputs (and stop aborts).

    A request with n samples has one state per sample index, made on its first delta. A stop string
    aborts the request in the scheduler only when n == 1 (abort ends every sample of a request; the
    TokenizerManager therefore runs n > 1 with stop strings as n single-sample requests).
    """

    def __init__(self, tok: HFTokenizer) -> None:
        self.tok = tok
        self.meta: dict[str, dict[str, Any]] = {}  # rid -> register message
        self.live: dict[tuple[str, int], RequestDetokenizer] = {}
        self.done: dict[str, set[int]] = {}  # rid -> sample indices already finished

    def register(self, reg: dict[str, Any]) -> None:
        self.meta[reg["rid"]] = reg
        self.done[reg["rid"]] = set()

    def drop(self, rid: str) -> None:
        reg = self.meta.pop(rid, None)
        self.done.pop(rid, None)
        for i in range(reg.get("n", 1) if reg else 0):
            self.live.pop((rid, i), None)

    def _state(self, rid: str, index: int) -> RequestDetokenizer | None:
        reg = self.meta.get(rid)
        if reg is None or index in self.done[rid]:  # aborted, or finished by a stop string: drop late deltas
            return None
        key = (rid, index)
        if key not in self.live:
            self.live[key] = RequestDetokenizer(self.tok, reg.get("prompt_tail", []), reg.get("stop"),
                                                reg.get("include_stop_str_in_output", False),
                                                reg.get("skip_special_tokens", True))
        return self.live[key]

    def process(self, delta: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """One engine TokenDelta -> (output item or None, whether the scheduler must abort the request)."""
        rid, index = delta["rid"], delta.get("index", 0)
        state = self._state(rid, index)
        if state is None:
            return None, False
        ids: list[int] = list(delta.get("ids") or [])
        lps = delta.get("lps")
        used, stopped = 0, False
        for tid in ids:
            used += 1
            if state.feed(tid):
                stopped = True
                break
        finished = stopped or bool(delta.get("finished"))
        if finished:
            state.finish()
        reg = self.meta[rid]
        item = {
            "rid": rid, "index": index, "text": state.take(finished), "ids": ids[:used],
            "lps": logprob_entries(self.tok, ids[:used], lps[:used]) if lps and reg.get("logprobs") else None,
            "finished": finished, "reason": "stop" if stopped else delta.get("reason"),
            "stop_str": state.stopped_by, "prompt_tokens": delta.get("prompt_tokens", 0),
            "cached_tokens": delta.get("cached_tokens", 0), "completion_tokens": len(state.output_ids),
        }
        abort = stopped and not delta.get("finished") and reg.get("n", 1) == 1
        if finished:
            self.live.pop((rid, index), None)
            self.done[rid].add(index)
            if len(self.done[rid]) >= reg.get("n", 1):
                self.drop(rid)
        return item, abort

    def handle_batch(self, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
        for reg in msg.get("register", []):
            self.register(reg)
        items, aborts = [], []
        for delta in msg.get("deltas", []):
            item, abort = self.process(delta)
            if item is not None:
                items.append(item)
            if abort:
                aborts.append(delta["rid"])
        for rid in msg.get("drop", []):
            self.drop(rid)
        return items, aborts


def run(cfg: dict[str, Any]) -> None:
    die_with_parent(cfg["parent_pid"])
    log = setup_child_logging("detokenizer", cfg.get("log_level", "info"))
    ends = ipc.Endpoints(**cfg["endpoints"])
    ctx = zmq.Context()
    pull = ipc.pull_socket(ctx, ends.detok_in)
    to_main = ipc.push_socket(ctx, ends.main_in)
    to_sched = ipc.push_socket(ctx, ends.sched_in)
    try:
        detok = Detokenizer(HFTokenizer(cfg["model_dir"]))
    except Exception as e:
        to_main.send(ipc.pack(ipc.FATAL, who="detokenizer", message=f"{type(e).__name__}: {e}"))
        raise
    to_main.send(ipc.pack(ipc.READY, who="detokenizer", info={}))
    log.info("ready")
    try:
        while True:
            for msg in ipc.drain(pull, 1000):
                if msg["t"] != ipc.BATCH:
                    continue
                items, aborts = detok.handle_batch(msg)
                for rid in aborts:
                    to_sched.send(ipc.pack(ipc.ABORT, rid=rid))
                if items:
                    to_main.send(ipc.pack(ipc.OUTPUTS, items=items))
    except Exception:
        to_main.send(ipc.pack(ipc.FATAL, who="detokenizer", message=traceback.format_exc()[-2000:]))
        raise


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
