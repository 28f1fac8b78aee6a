"""IPC messages: msgpack round trip of plain data only; anything else (pickle included) is refused."""

from __future__ import annotations

import os
import pickle

import msgpack
import pytest

from dsaserve.server import ipc


def test_messages_round_trip_as_plain_data():
    msg = ipc.pack(ipc.GENERATE, rid="r1", input_ids=[0, 5, 511], sampling={"temperature": 0.5, "stop": ["x"]},
                   detok={"prompt_tail": [5], "skip_special_tokens": True}, arrival_time=1.5)
    assert ipc.unpack(msg) == {"t": "generate", "rid": "r1", "input_ids": [0, 5, 511],
                               "sampling": {"temperature": 0.5, "stop": ["x"]},
                               "detok": {"prompt_tail": [5], "skip_special_tokens": True}, "arrival_time": 1.5}


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/dsaserve-pickle-was-executed",))


@pytest.mark.parametrize("data", [
    pickle.dumps(_Boom()),  # a pickle bomb is just undecodable bytes here
    b"\xc1", b"", msgpack.packb([1, 2]), msgpack.packb({"no_kind": 1}), msgpack.packb({"t": 5}),
    msgpack.packb({1: "int keys"}), msgpack.packb({"t": "x"}) + b"trailing",
])
def test_anything_but_a_kinded_map_is_refused(data):
    with pytest.raises(ValueError):
        ipc.unpack(data)
    assert not os.path.exists("/tmp/dsaserve-pickle-was-executed")


def test_oversized_messages_are_refused_before_decoding(monkeypatch):
    monkeypatch.setattr(ipc, "MAX_MESSAGE_BYTES", 16)
    with pytest.raises(ValueError, match="exceeds"):
        ipc.unpack(ipc.pack("x", payload="y" * 64))


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_make_ipc_dir_is_private_and_names_its_owner(tmp_path):
    d = ipc.make_ipc_dir(tmp_path)
    assert d.parent == tmp_path and d.name.startswith(ipc.IPC_DIR_PREFIX)
    assert (d.stat().st_mode & 0o777) == 0o700
    assert (d / ipc.OWNER_FILE).read_text().strip() == str(os.getpid())


def test_make_ipc_dir_removes_the_dirs_of_dead_servers_and_keeps_live_ones(tmp_path):
    dead = ipc.make_ipc_dir(tmp_path)  # as a `kill -9`ed main process leaves it
    (dead / ipc.OWNER_FILE).write_text(f"{_dead_pid()}\n")
    live = ipc.make_ipc_dir(tmp_path)  # ours: this process is alive
    fresh_unowned = tmp_path / (ipc.IPC_DIR_PREFIX + "mid-creation")
    fresh_unowned.mkdir()
    old_unowned = tmp_path / (ipc.IPC_DIR_PREFIX + "older-dsaserve")
    old_unowned.mkdir()
    (old_unowned / "sched_in").touch()  # a socket file nobody listens on any more
    os.utime(old_unowned, (0, 0))
    other = tmp_path / "not-ours"
    other.mkdir()
    new = ipc.make_ipc_dir(tmp_path)
    assert not dead.exists() and not old_unowned.exists()
    assert live.exists() and fresh_unowned.exists() and other.exists() and new.exists()


def test_an_unowned_dir_with_a_listening_socket_is_kept():
    import socket
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as root:  # short: a socket path has at most 107 bytes
        d = Path(root) / (ipc.IPC_DIR_PREFIX + "old")
        d.mkdir()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(str(d / "main_in"))
            s.listen(1)
            os.utime(d, (0, 0))
            assert ipc.stale_ipc_dirs(Path(root)) == []
