"""engine/compiled_specs.py, and the precompile's use of it: a spec is known compiled while its Triton cache
entry exists under the same stamp; a warm start (every listed spec known) starts no precompile process; the
precompile marks what it replayed, failures included; a deleted entry or another stamp replays again."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from dsaserve.engine import compiled_specs as cs
from dsaserve.engine import kernel_precompile as kp

HASH_A, HASH_B = "ab" * 32, "cd" * 32  # Triton's kernel hashes: sha256 hex


def _dir(triton: Path, h: str) -> Path:
    return triton / base64.b32encode(bytes.fromhex(h)).decode().rstrip("=")


def _spec(name: str) -> str:
    return json.dumps({"name": f"some.module.{name}", "signature": {}, "options": {}})


@pytest.fixture
def store(tmp_path):
    return cs.CompiledSpecs(tmp_path / cs.FILE, tmp_path / "triton")


def test_a_spec_is_known_while_its_entry_exists(store, tmp_path):
    a, b, failed = _spec("a"), _spec("b"), _spec("gone")
    assert store.pending([a, b, failed]) == [a, b, failed]  # no file yet
    store.mark({a: HASH_A, b: HASH_B, failed: None})
    _dir(tmp_path / "triton", HASH_A).mkdir(parents=True)
    # b's entry is not on disk (a deleted Triton cache): replayed; a failed replay is not retried
    assert store.pending([a, b, failed]) == [b]
    _dir(tmp_path / "triton", HASH_B).mkdir()
    assert store.pending([a, b, failed]) == []
    with open(store.path, "a") as f:
        f.write('{"d": "torn')  # a writer died mid-line
    assert store.pending([a, b]) == []


def test_another_stamp_forgets_everything(store, tmp_path, monkeypatch):
    a = _spec("a")
    store.mark({a: HASH_A})
    _dir(tmp_path / "triton", HASH_A).mkdir(parents=True)
    assert store.pending([a]) == []
    monkeypatch.setattr(cs, "stamp", lambda: {"triton": "9.9", "code": "other"})  # a kernel's source changed
    assert store.pending([a]) == [a]
    store.mark({_spec("b"): HASH_B})  # the file starts afresh under the new stamp
    assert json.loads(store.path.read_text().splitlines()[0]) == {"stamp": {"triton": "9.9", "code": "other"}}
    assert len(store.read()) == 1


def test_a_damaged_file_counts_as_empty_or_loses_only_its_bad_lines(store, tmp_path):
    a, b = _spec("a"), _spec("b")
    store.mark({a: HASH_A})
    _dir(tmp_path / "triton", HASH_A).mkdir(parents=True)
    good = store.path.read_bytes()
    store.path.write_bytes(good + json.dumps({"d": cs.digest(b), "e": 7}).encode() + b"\n")  # not an entry
    assert store.read() == {cs.digest(a): HASH_A} and store.pending([a, b]) == [b]
    store.path.write_bytes(b"\xff\xfe not utf-8\n")
    assert store.read() == {}
    store.path.write_bytes(b"{not json\n" + good.split(b"\n", 1)[1])  # the stamp line lost: nothing trusted
    assert store.read() == {} and store.pending([a]) == [a]


def test_stamp_reads_tritons_version_without_importing_it():
    import sys

    triton = pytest.importorskip("triton")
    v = cs.triton_version()
    assert v == triton.__version__ and "triton" in sys.modules
    assert len(cs.code_version()) == 16


def test_the_hook_entry_is_the_kernel_the_jit_cached():
    class Kernel:
        hash = HASH_A

    class Fn:
        device_caches = {0: ({"k": Kernel()}, {}, None, None, None)}

    class Info:
        jit_function = Fn()

    assert cs.entry_of_hook({"fn": Info(), "key": "k", "compile": {"device": 0}}) == HASH_A
    assert cs.entry_of_hook({"fn": Info(), "key": "other", "compile": {"device": 0}}) is None
    assert cs.entry_of_hook({"key": "k"}) is None  # a Triton whose hook passes no fn


def test_a_warm_start_starts_no_precompile(caches, monkeypatch):
    a, b = _spec("a"), _spec("b")
    own = caches / "dsaserve" / kp.SPECS_FILE
    kp.write_atomic(own, a + "\n" + b + "\n")
    kp.compiled_specs().mark({a: HASH_A, b: HASH_B})
    for h in (HASH_A, HASH_B):
        _dir(caches / "triton", h).mkdir(parents=True)
    assert kp.start() is None and kp.take_pending() is None
    assert kp.skipped()["specs"] == 2 and kp.skipped()["status"].startswith("skipped")

    # b's entry deleted: only b is replayed (the todo list handed to the process holds b alone)
    _dir(caches / "triton", HASH_B).rmdir()
    monkeypatch.setattr(kp, "_skipped", None)
    started = []

    class Proc:
        def __init__(self, cmd, **kw):
            started.append(Path(cmd[-1]).read_text())

    monkeypatch.setattr(kp.subprocess, "Popen", Proc)
    handle = kp.start()
    assert handle is not None and handle.known == 1 and kp.skipped() is None
    assert started == [b + "\n"]


def test_the_recorder_marks_what_the_jit_loaded(caches):
    rec = kp.SpecRecorder()
    assert rec.compiled is not None and rec.compiled.path == caches / "dsaserve" / cs.FILE
    a, b = _spec("a"), _spec("b")
    rec.add(a, HASH_A)
    rec.add(b, None)  # its entry unknown: left to the next start's replay
    _dir(caches / "triton", HASH_A).mkdir(parents=True)
    assert rec.compiled.pending([a, b]) == [a, b]  # nothing marked before Up
    rec.save()
    assert rec.compiled.pending([a, b]) == [b]
    c = _spec("c")
    rec.add(c, HASH_B)  # after Up: marked at once
    _dir(caches / "triton", HASH_B).mkdir()
    assert rec.compiled.pending([a, b, c]) == [b]


def test_an_unwritable_cache_replays_the_whole_lists(caches, monkeypatch):
    own = caches / "dsaserve" / kp.SPECS_FILE
    kp.write_atomic(own, _spec("a") + "\n")
    started = []

    class Proc:
        def __init__(self, cmd, **kw):
            started.append(cmd[-1])

    def unwritable(path, text):
        raise PermissionError(path)

    monkeypatch.setattr(kp.subprocess, "Popen", Proc)
    monkeypatch.setattr(kp, "write_atomic", unwritable)
    handle = kp.start()
    assert handle is not None and handle.todo is None and started == [str(own)]


@pytest.mark.parametrize(("local_rank", "marks"), [("0", True), ("1", False), (None, True)])
def test_only_the_hosts_first_rank_marks_at_up(caches, monkeypatch, local_rank, marks):
    """The ranks of one host share the cache: were each to mark at Up, a stale stamp's file would be rewritten
    by each and the last rename would drop the others' lines. Only LOCAL_RANK 0 (or one process) marks; every
    rank still saves its spec list."""
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    a, b = _spec("a"), _spec("b")
    rec = kp.SpecRecorder()
    rec.add(a, HASH_A)
    rec.save()
    rec.add(b, HASH_B)  # after Up
    marks_file = caches / "dsaserve" / cs.FILE
    assert kp.read_specs([rec.path]) == [a, b]
    assert marks_file.exists() == marks and (rec.compiled is not None) == marks
    if marks:
        assert kp.compiled_specs().read() == {cs.digest(a): HASH_A, cs.digest(b): HASH_B}
