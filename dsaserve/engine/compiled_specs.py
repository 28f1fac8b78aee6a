"""Which recorded Triton kernel specs this Triton disk cache already holds (issue 16: "<= 5 s warm").

Owns: `<cache>/compiled_specs.jsonl` — one line per spec known to be in the cache: the spec line's digest and
the cache entry its kernel went to (`CompiledKernel.hash`: the entry directory is named by it), or `null` for a
spec that failed to replay (it would fail again: no retry under the same stamp). The first line is the stamp:
Triton's version and dsaserve's source hash (`code_version`); under another stamp the file counts as empty
(a changed kernel compiles to another entry under the same spec line). Who writes it: the precompile process
(each spec it replayed) and the engine's spec recorder (each kernel its JIT compiled or loaded, so the
cache's own list is known compiled at the next start without a replay). Who reads it: `kernel_precompile.start`,
which replays only the specs not known compiled, and starts no process at all when none are left. Also
`write_atomic`, the temporary-file-and-rename write the spec lists and the warm-start record use too.

Why: on a warm start every spec was compiled by an earlier start, yet the replay still started a process
that imported torch and Triton, forked 15 workers that re-hashed every spec, and held the engine ~0.9 s before
its first forward (and any spec whose replay key differs from the JIT's was compiled again each time). The
entry is checked to exist, so a deleted Triton cache replays again. Module scope: standard library only
(read before torch is imported).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

FILE = "compiled_specs.jsonl"


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """A hash of dsaserve's Python source: a record of other code may name kernels called differently."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def triton_version() -> str | None:
    """The importable Triton's version, read from its source without importing it (~1 s of imports)."""
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        text = Path(spec.origin).read_text()
    except OSError:
        return None
    m = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return m.group(1) if m else None


def stamp() -> dict[str, Any]:
    return {"triton": triton_version(), "code": code_version()}


def digest(spec: str) -> str:
    return hashlib.sha256(spec.strip().encode()).hexdigest()[:24]


class CompiledSpecs:
    """The file of one dsaserve cache, for the Triton cache directory `triton_dir`."""

    def __init__(self, path: Path, triton_dir: Path) -> None:
        self.path, self.triton_dir = path, triton_dir

    def read(self) -> dict[str, str | None]:
        """digest -> cache entry (None: a spec that failed to replay); empty under another stamp."""
        try:
            lines = self.path.read_text().splitlines()
        except (OSError, ValueError):  # ValueError: not UTF-8 (a foreign or damaged file counts as empty)
            return {}
        out: dict[str, str | None] = {}
        for i, line in enumerate(lines):
            try:
                d = json.loads(line)
            except ValueError:
                if i == 0:
                    return {}  # no stamp to trust the rest by
                continue  # a torn line (a writer died mid-append)
            if i == 0:
                if not isinstance(d, dict) or d.get("stamp") != stamp():
                    return {}
                continue
            if isinstance(d, dict) and isinstance(d.get("d"), str) and isinstance(d.get("e"), str | None):
                out[d["d"]] = d.get("e")
        return out

    def pending(self, specs: Iterable[str]) -> list[str]:
        """The specs not known compiled in this cache: no line for them, or their entry is gone."""
        known = self.read()
        return [s for s in specs if not self._present(known, digest(s))]

    def _present(self, known: Mapping[str, str | None], key: str) -> bool:
        if key not in known:
            return False
        entry = known[key]
        return entry is None or any((self.triton_dir / name).is_dir() for name in entry_dirs(entry))

    def mark(self, entries: Mapping[str, str | None]) -> None:
        """spec line -> its cache entry (None: failed) added; a file of another stamp is started afresh."""
        if not entries:
            return
        body = "".join(json.dumps({"d": digest(s), "e": e}) + "\n" for s, e in entries.items())
        if _has_current_stamp(self.path):
            with open(self.path, "a") as f:  # one write of a few lines: concurrent writers do not interleave
                f.write(body)
            return
        write_atomic(self.path, json.dumps({"stamp": stamp()}) + "\n" + body)


def write_atomic(path: Path, text: str) -> None:
    """`text` to `path` through a temporary file and a rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def entry_dirs(entry: str) -> list[str]:
    """The directory names a kernel hash may have in Triton's cache: base32 of the hex hash (Triton >= 3.2's
    `get_cache_manager`), or the hash itself (older)."""
    try:
        return [base64.b32encode(bytes.fromhex(entry)).decode().rstrip("="), entry]
    except ValueError:
        return [entry]


def _has_current_stamp(path: Path) -> bool:
    try:
        with open(path) as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return isinstance(first, dict) and first.get("stamp") == stamp()


def entry_of_hook(kwargs: Mapping[str, Any]) -> str | None:
    """The cache entry of the kernel a `jit_post_compile_hook` call reports: the JIT put the kernel in its
    in-memory cache under `key` just before calling the hook (Triton 3.4-3.9 `_do_compile`). None when this
    Triton keeps it elsewhere, or the async compile mode handed back a future."""
    try:
        fn = kwargs["fn"].jit_function
        device = kwargs["compile"]["device"]
        kernel = fn.device_caches[device][0].get(kwargs["key"])
    except (KeyError, AttributeError, IndexError, TypeError):
        return None
    h = getattr(kernel, "hash", None)
    return h if isinstance(h, str) else None
