"""IPC between the server's processes: ZMQ sockets, msgpack messages, never pickle (request path stage 2).

Owns: the message vocabulary and its encoding, and the three socket addresses of one server.
Topology (SGLang's, note 000): every process binds one PULL socket and PUSHes to the others.

    main (HTTP + TokenizerManager)  --generate/abort/stats-->        scheduler  (sched_in)
    detokenizer                     --abort (one sample's stop string hit)--> scheduler (sched_in)
    scheduler                       --register/deltas/drop-->        detokenizer (detok_in)
    detokenizer                     --outputs-->                     main (main_in)
    scheduler                       --ready/stats/reject/fatal-->    main (main_in)

A message is a msgpack map with its kind under "t"; everything in it is a str, int, float, bool, None,
list or str-keyed map, so decoding untrusted bytes can only ever produce plain data. One socket pair
keeps order (ZMQ PUSH/PULL is FIFO per peer), which the protocol relies on: the scheduler sends a
request's `register` to the detokenizer before any of its token deltas.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq

# message kinds
GENERATE = "generate"  # main -> scheduler: rid, input_ids, sampling (SamplingParams dict), detok (dict)
ABORT = "abort"  # main/detokenizer -> scheduler: rid, index (one sample of an n > 1 request; None/absent: all)
STATS_REQ = "stats_req"  # main -> scheduler: qid
STATS = "stats"  # scheduler -> main: qid, stats, counters
READY = "ready"  # scheduler/detokenizer -> main: who, info
REJECT = "reject"  # scheduler -> main: rid, message (EngineCore.add_request raised ValueError)
FATAL = "fatal"  # scheduler/detokenizer -> main: who, message (the process is about to exit)
BATCH = "batch"  # scheduler -> detokenizer: register [...], deltas [...], drop [rid...]
OUTPUTS = "outputs"  # detokenizer -> main: items [...]
GRAMMAR_CHECK = "grammar_check"  # main -> scheduler: qid, spec (GrammarSpec dict): compile it (cached), answer
GRAMMAR_RESULT = "grammar_result"  # scheduler -> main: qid, error (None: compiled; else the reason, for a 400)

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # refuse to decode anything larger (a 1M-token prompt is ~5 MB)


def pack(kind: str, **fields: Any) -> bytes:
    fields["t"] = kind
    return msgpack.packb(fields, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"ipc: message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (msgpack.UnpackException, TypeError) as e:
        raise ValueError(f"ipc: undecodable message ({e})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ValueError("ipc: message is not a map with a string 't' kind")
    return msg


@dataclass(frozen=True)
class Endpoints:
    """ipc:// addresses of one server's three PULL sockets (a private temp directory, mode 0700)."""

    sched_in: str
    detok_in: str
    main_in: str

    @classmethod
    def in_dir(cls, directory: str | Path) -> Endpoints:
        d = Path(directory)
        os.chmod(d, 0o700)
        return cls(*(f"ipc://{d / name}" for name in ("sched_in", "detok_in", "main_in")))

    def to_dict(self) -> dict[str, str]:
        return {"sched_in": self.sched_in, "detok_in": self.detok_in, "main_in": self.main_in}


def pull_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(addr)
    return sock


def push_socket(ctx: zmq.Context, addr: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    # LINGER 0: a dying peer must never block our exit; SNDHWM 0: never drop or block on a slow reader
    # (every process drains its PULL socket continuously, so the queue stays short).
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(addr)
    return sock


def drain(sock: zmq.Socket, timeout_ms: int) -> list[dict[str, Any]]:
    """Wait up to timeout_ms for a first message, then take every message already queued (blocking API)."""
    msgs: list[dict[str, Any]] = []
    if not sock.poll(timeout_ms):
        return msgs
    while True:
        try:
            data = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return msgs
        try:
            msgs.append(unpack(data))
        except ValueError as e:  # only our own processes connect; a bad message is a bug, not a reason to die
            log.error("ipc: dropped a malformed message (%s)", e)
