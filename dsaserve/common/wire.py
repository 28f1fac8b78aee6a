"""Between processes: wire-safe values — what may cross a process boundary as msgpack (IPC between the
server's processes, the control plane between ranks) — and a free port for ranks to meet on. Owns `plain`,
the one conversion every sender applies to stats, manifests and deltas, and `free_port`. Pure Python:
nothing of the package, no torch.
"""

from __future__ import annotations

import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the default rendezvous of ranks on one machine)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plain(obj: Any) -> Any:
    """Numbers, strings, lists and str-keyed maps as they are; numpy / torch scalars as numbers; else str."""
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [plain(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):
        return plain(obj.item())
    return str(obj)
