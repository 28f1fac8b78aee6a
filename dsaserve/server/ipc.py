"""IPC between the server's processes: ZMQ sockets, msgpack messages, never pickle (request path stage 2).

Owns: the message vocabulary and its encoding, the three socket addresses of one server, and their private
directory: `make_ipc_dir()` writes the owner's pid into it and first removes the directories of servers
whose main process died without cleaning up (`kill -9`, OOM killer).
Topology (SGLang's, note 000): every process binds one PULL socket and PUSHes to the others.

    main (HTTP + TokenizerManager)  --generate/abort/stats-->        scheduler  (sched_in)
    detokenizer                     --abort (one sample's stop string hit)--> scheduler (sched_in)
    scheduler                       --register/deltas/drop-->        detokenizer (detok_in)
    detokenizer                     --outputs-->                     main (main_in)
    scheduler                       --ready/stats/reject/fatal-->    main (main_in)

A message is a msgpack map with its kind under "t"; everything in it is a str, bytes, int, float, bool, None,
list or str-keyed map, so decoding untrusted bytes can only ever produce plain data (long runs of numbers may
cross as bytes: pack_ints / pack_floats). One socket pair keeps order (ZMQ PUSH/PULL is FIFO per peer), which
the protocol relies on: the scheduler sends a request's `register` to the detokenizer before any of its token
deltas.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import socket
import tempfile
import time
from array import array
from collections.abc import Iterator
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

IPC_DIR_PREFIX = "dsaserve-ipc-"
OWNER_FILE = "owner.pid"  # the main process's pid, written by make_ipc_dir
UNOWNED_GRACE_S = 60.0  # a directory without an owner file (older dsaserve, or mid-creation) is spared this long
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # refuse to decode anything larger (a 1M-token prompt is ~5 MB)
GC_PAUSE_BYTES = 64 * 1024  # unpack pauses the garbage collector for messages this large (_unpackb)


def pack(kind: str, **fields: Any) -> bytes:
    fields["t"] = kind
    return msgpack.packb(fields, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise ValueError(f"ipc: message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = _unpackb(data)
    except (msgpack.UnpackException, TypeError) as e:
        raise ValueError(f"ipc: undecodable message ({e})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ValueError("ipc: message is not a map with a string 't' kind")
    return msg


def pack_ints(values: list[int]) -> bytes:
    """Many integers as one msgpack bin (int64, this machine's byte order: both ends are its processes): decoding
    a list of 690K numbers is ~0.1 s of the receiver's loop, a bin a copy."""
    return array("q", values).tobytes()


def unpack_ints(data: bytes) -> list[int]:
    a = array("q")
    a.frombytes(data)
    return a.tolist()


def pack_floats(values: list[float]) -> bytes:
    """Many floats as one msgpack bin (float64: every value exactly; ints become floats, as float() makes them)."""
    return array("d", values).tobytes()


def unpack_floats(data: bytes) -> list[float]:
    a = array("d")
    a.frombytes(data)
    return a.tolist()


def _unpackb(data: bytes) -> Any:
    """msgpack.unpackb, the garbage collector paused for a large message: decoding makes only new, acyclic
    containers, so the collections their count triggers free nothing, and the full ones walk every container of the
    process (a 32K-token prompt's logprobs as the scheduler sends them: 1.4M lists and dicts, 0.7 s to unpack with
    the collector on, 0.1 s paused)."""
    with gc_paused() if len(data) >= GC_PAUSE_BYTES else contextlib.nullcontext():
        return msgpack.unpackb(data, raw=False, strict_map_key=True)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No garbage collection inside (unless it was off already): for work that makes many containers and no cycles,
    or holds huge lists each collection would walk."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


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


def make_ipc_dir(root: str | Path | None = None) -> Path:
    """A new private (0700) directory for one server's sockets under `root` (default: the temp dir), holding
    this process's pid; stale directories of dead servers there are removed first."""
    base = Path(root if root is not None else tempfile.gettempdir())
    for stale in stale_ipc_dirs(base):
        log.info("removing %s: its server is gone", stale)
        shutil.rmtree(stale, ignore_errors=True)
    d = Path(tempfile.mkdtemp(prefix=IPC_DIR_PREFIX, dir=base))
    (d / OWNER_FILE).write_text(f"{os.getpid()}\n")
    return d


def stale_ipc_dirs(base: Path) -> list[Path]:
    """This user's `dsaserve-ipc-*` directories under `base` whose server is gone: the owner pid is dead, or
    (no owner file, older than UNOWNED_GRACE_S) no socket in it accepts a connection."""
    return [d for d in sorted(base.glob(IPC_DIR_PREFIX + "*")) if _is_stale(d)]


def _is_stale(d: Path) -> bool:
    try:
        st = d.lstat()
        if not d.is_dir() or d.is_symlink() or st.st_uid != os.getuid():
            return False
        pid = _owner_pid(d)
        if pid is not None:
            return not pid_alive(pid)
        return time.time() - st.st_mtime > UNOWNED_GRACE_S and not _any_socket_listening(d)
    except OSError:  # removed by another server's clean-up meanwhile
        return False


def _owner_pid(d: Path) -> int | None:
    try:
        return int((d / OWNER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (an unreaped zombie counts as dead: it will never clean up)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process reused the pid
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _any_socket_listening(d: Path) -> bool:
    for path in d.iterdir():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s, contextlib.suppress(OSError):
            s.connect(str(path))
            return True
    return False
