"""Errors every layer shares (ground floor: imports nothing of the package, no torch).

Owns: `CheckpointError`, the one exception type for "the model on disk cannot be served": a config.json
that is not JSON or lacks a field, a bad shard index, a missing or truncated shard, a missing tensor, a
tensor of the wrong shape/dtype, a non-finite weight or scale. Its message is one line that names the
file or the tensor; the `generate` / `serve` entry points print it as `error: <message>` and exit 2
(no traceback: the message is the whole diagnosis).
"""

from __future__ import annotations


class CheckpointError(ValueError):
    """The checkpoint on disk does not match what the model needs; the one-line message names the file/tensor."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))  # one line, whatever the cause's text held
