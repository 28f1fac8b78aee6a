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
