"""engine/kernel_precompile.py without a GPU: a spec recorded as Triton's JIT serialises it compiles (for sm_90,
offline) into the disk-cache entry the JIT itself would then look up; bad specs are counted, not fatal; the
recorder chains hooks and keeps one list; the engine's handle runs the precompile process and reads its report."""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import serialize_specialization_data  # noqa: E402

from dsaserve.common import envs  # noqa: E402
from dsaserve.engine import kernel_precompile as kp  # noqa: E402
from dsaserve.engine.compiled_specs import entry_dirs  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * factor, mask=mask)


def _jit_view(block: int) -> tuple[dict, dict, dict, object]:
    """(signature, constexprs, attrs, options) as the JIT forms them for a launch with 16-aligned pointers and n."""
    sig = {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "factor": "fp32", "BLOCK": "constexpr"}
    consts = {(4,): block}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]}
    options = make_backend(TARGET).parse_options({"num_warps": 4})
    return sig, consts, attrs, options


# Triton 3.9 serialises the target too; 3.6 (the H200's) takes no `target` and writes none (compile_spec then
# reads it from the options): build the spec as the installed Triton's JIT would.
_SERIALIZE_TAKES_TARGET = "target" in inspect.signature(serialize_specialization_data).parameters


def _spec(block: int) -> str:
    sig, consts, attrs, options = _jit_view(block)
    args = (f"{__name__}._scale_kernel", sig, consts, attrs, options, "key")
    return serialize_specialization_data(*args, *([TARGET] if _SERIALIZE_TAKES_TARGET else []))


def test_spec_is_the_installed_tritons_format():
    """The helper builds what this Triton's JIT writes: a target exactly when its serialiser takes one."""
    d = json.loads(_spec(16))
    assert d["name"].endswith("._scale_kernel") and d["options"]["arch"] == "sm90"
    assert ("target" in d) == _SERIALIZE_TAKES_TARGET


def _entries(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


def test_replayed_spec_fills_the_entry_the_jit_reads(caches):
    assert kp.compile_spec(_spec(128)) is None
    made = _entries(caches / "triton")
    assert made, "the precompile wrote no cache entry"
    # the JIT's own compile of the same launch (jit.py _do_compile): a hit, nothing new on disk
    sig, consts, attrs, options = _jit_view(128)
    kernel = triton.compile(ASTSource(_scale_kernel, sig, consts, attrs), target=TARGET, options=options.__dict__)
    assert _entries(caches / "triton") == made
    assert kernel.metadata.num_warps == 4
    # another specialisation is another entry
    assert kp.compile_spec(_spec(256)) is None
    assert len(_entries(caches / "triton")) > len(made)


def test_precompile_counts_and_survives_bad_specs(caches):
    gone = json.dumps({**json.loads(_spec(64)), "name": f"{__name__}._no_such_kernel"})
    report = kp.precompile([_spec(64), gone, _spec(32)], jobs=2)
    assert report["specs"] == 3 and report["failed"] == 1
    assert "_no_such_kernel" in report["errors"][0]
    assert report["compiled"] >= 2
    again = kp.precompile([_spec(64), _spec(32)], jobs=1)  # warm: every spec a hit
    assert again["compiled"] == 0 and again["failed"] == 0


def test_precompile_marks_what_it_replayed(caches):
    """Each replayed spec is marked with the entry it compiled to; a failed one too (not retried)."""
    gone = json.dumps({**json.loads(_spec(64)), "name": f"{__name__}._no_such_kernel"})
    store = kp.compiled_specs()
    assert store.pending([_spec(64), gone]) == [_spec(64), gone]
    report = kp.precompile([_spec(64), gone], jobs=2, compiled=store)
    assert report["failed"] == 1 and store.pending([_spec(64), gone, _spec(32)]) == [_spec(32)]
    (entry,) = [e for e in store.read().values() if e]
    assert any((caches / "triton" / d).is_dir() for d in entry_dirs(entry))  # the entry Triton wrote


def test_recorder_chains_and_keeps_one_list(caches):
    from triton import knobs

    seen = []
    previous = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: seen.append(kw["key"])
    try:
        rec = kp.SpecRecorder()
        hook = knobs.runtime.jit_post_compile_hook
        for block in (16, 32, 16):
            hook(key=block, compile={"specialization_data": _spec(block)})
        assert seen == [16, 32, 16] and len(rec.specs) == 2
        assert rec.path == caches / "dsaserve" / kp.SPECS_FILE
        rec.path.parent.mkdir(parents=True)
        rec.path.write_text(_spec(16) + "\n{torn\n")  # an earlier start's list, its last line cut short
        assert rec.save() == 2
        hook(key=64, compile={"specialization_data": _spec(64)})  # after Up: appended at once
        assert kp.read_specs([rec.path]) == [_spec(16), _spec(32), _spec(64)]
        assert kp.spec_files() == [rec.path]
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_start_runs_the_recorded_lists(caches, monkeypatch):
    assert kp.start() is None  # nothing recorded yet
    extra = caches / "shipped.jsonl"
    extra.write_text(_spec(512) + "\n")
    monkeypatch.setenv("DSASERVE_KERNEL_SPECS", str(extra))
    monkeypatch.setenv("DSASERVE_PRECOMPILE", "0")
    envs.reload()
    assert kp.start() is None  # switched off
    monkeypatch.delenv("DSASERVE_PRECOMPILE")
    envs.reload()
    monkeypatch.setattr(kp, "_pending", None)
    # the precompile process imports the kernel by its module name, as pytest imported this file
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    handle = kp.start()
    assert handle is not None and kp.take_pending() is handle
    report = handle.wait()
    assert report["specs"] == 1 and report["failed"] == 0 and report["compiled"] >= 1, report
    assert report["lists"] == [str(extra)] and report["wall_s"] >= report["waited_s"] >= 0
    assert handle.wait() is report
    assert not handle.todo.exists()  # the process's own list of what was left to compile
    # the next start: the process marked the spec compiled, so none is started
    monkeypatch.setattr(kp, "_pending", None)
    assert kp.start() is None and kp.skipped()["specs"] == 1


def test_packaged_lists_come_last_and_the_shipped_one_is_for_an_h200():
    """A list shipped with the package is replayed on an empty cache too (after the cache's own and the user's)."""
    shipped = sorted(Path(kp.__file__).with_name("kernel_specs").glob("*.jsonl"))
    assert shipped and all(p.name.startswith("sm90-") for p in shipped)
    specs = kp.read_specs(shipped)
    assert len(specs) > 50 and all(json.loads(s)["options"]["arch"] == "sm90" for s in specs)
    assert not any("extern_libs" in json.loads(s)["options"] for s in specs)  # the recording machine's paths


def _spec_against_kernel(spec: str) -> str | None:
    """What a packaged spec says of its kernel's parameters that the kernel no longer has, else None."""
    d = json.loads(spec)
    try:
        fn = kp.resolve_jit(d["name"])
    except (ImportError, AttributeError) as e:
        return f"{d['name']}: no such kernel ({e})"
    names = list(d["signature"])
    if names != list(fn.arg_names):
        return f"{d['name']}: the spec's arguments {names} are not the kernel's {list(fn.arg_names)}"
    held = {i for i, kind in enumerate(d["signature"].values()) if kind == "constexpr"}
    kernel = {i for i, p in enumerate(fn.params) if p.is_constexpr}
    constants = {k[0] for k in d["constant_keys"]}
    if not kernel <= held or constants != held:
        return f"{d['name']}: constexpr positions {sorted(kernel)} in the kernel, {sorted(held)} in the spec"
    return None


def test_packaged_specs_match_the_kernels_signatures():
    """A kernel whose arguments changed leaves its shipped lines compiling entries no launch asks for: the first
    start on an empty cache then compiles it after all (the twenty-ninth stop rewrote two such kernels' lines).
    Re-record on an H200 (bench/startup_cold_warm.py --no-load) or mend the lines when a signature changes."""
    shipped = sorted(Path(kp.__file__).with_name("kernel_specs").glob("*.jsonl"))
    stale = [why for why in map(_spec_against_kernel, kp.read_specs(shipped)) if why]
    assert not stale, "\n".join(stale)


def test_a_stale_spec_is_named():
    spec = json.loads(_spec(16))
    spec["signature"] = {"x_ptr": "*fp32", "n": "i32", "factor": "fp32", "BLOCK": "constexpr"}
    assert "are not the kernel's" in _spec_against_kernel(json.dumps(spec))
    assert _spec_against_kernel(_spec(16)) is None
    spec["name"] = spec["name"] + "_gone"
    assert "no such kernel" in _spec_against_kernel(json.dumps(spec))


def test_a_packaged_list_is_replayed_after_the_others(caches, monkeypatch):
    (caches / "packaged").mkdir()
    shipped = caches / "packaged" / "sm90-x.jsonl"
    shipped.write_text(_spec(16) + "\n")
    extra = caches / "extra.jsonl"
    extra.write_text(_spec(32) + "\n")
    monkeypatch.setenv("DSASERVE_KERNEL_SPECS", str(extra))
    envs.reload()
    assert kp.spec_files() == [extra, shipped]


def test_a_spec_without_a_target_takes_its_options_arch():
    """Triton 3.6 (the H200's) serialises no target: the options' backend, arch and warp size give it."""
    got = kp._target({"options": {"backend_name": "cuda", "arch": "sm90", "warp_size": 32}}, lambda *a: a)
    assert got == ("cuda", 90, 32)
    assert kp._target({"target": {"backend": "cuda", "arch": 90, "warp_size": 32}}, lambda **k: k)["arch"] == 90


def test_a_failed_append_after_up_is_logged_once_not_raised(caches, caplog):
    """A kernel seen after Up is appended inside its launch: an unwritable list (full disk, read-only cache) must
    not raise there; one warning, the spec still recorded, writable mirrors still appended."""
    from triton import knobs

    previous = knobs.runtime.jit_post_compile_hook
    try:
        rec = kp.SpecRecorder()
        hook = knobs.runtime.jit_post_compile_hook
        rec.save()
        rec.path.unlink()
        rec.path.mkdir()  # the list's path is now unwritable as a file (root ignores permission bits)
        blocker = caches / "not_a_dir"
        blocker.write_text("")
        good = caches / "mirror.jsonl"
        rec.mirrors += [blocker / "warm.jsonl", good]
        with caplog.at_level("WARNING", logger=kp.__name__):
            for block in (16, 32):
                hook(key=block, compile={"specialization_data": _spec(block)})
        assert list(rec.specs) == [_spec(16), _spec(32)]
        assert kp.read_specs([good]) == [_spec(16), _spec(32)]
        warnings = [r for r in caplog.records if r.name == kp.__name__]
        assert len(warnings) == 1 and "not appended" in warnings[0].getMessage()
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def test_a_start_that_never_waits_leaves_no_todo_list(caches):
    """A process that started the precompile and then failed before its wait (its start-up raised, sys.exit)
    leaves no `precompile_todo.<pid>.jsonl` behind: removed at its exit. The precompile process here never reads
    the list (a stand-in that does nothing), so the exit hook alone removes it."""
    import subprocess
    import sys

    own = caches / "dsaserve" / kp.SPECS_FILE
    kp.write_atomic(own, _spec(16) + "\n")
    code = (
        "import sys, subprocess\n"
        "from dsaserve.engine import kernel_precompile as kp\n"
        "class Idle:\n"
        "    def __init__(self, cmd, **kw): pass\n"
        "kp.subprocess.Popen = Idle\n"
        "h = kp.start()\n"
        "print(h.todo, h.todo.exists(), flush=True)\n"
        "raise SystemExit('start-up failed before the wait')\n")
    env = {**os.environ, "DSASERVE_CACHE_DIR": str(caches / "dsaserve"), "TRITON_CACHE_DIR": str(caches / "triton")}
    env.pop("LOCAL_RANK", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 1 and "start-up failed" in out.stderr
    todo, existed = out.stdout.split()
    assert existed == "True" and Path(todo).parent == caches / "dsaserve"
    assert not Path(todo).exists() and not list((caches / "dsaserve").glob("precompile_todo.*"))


def test_the_precompile_process_removes_its_todo_list_once_read(caches):
    """The process removes the list once read (a parent killed past the exit hook leaves none either); a list
    that is not a todo list (the cache's own, a shipped one) is left alone."""
    todo = caches / "dsaserve" / "precompile_todo.1.jsonl"
    kept = caches / "shipped.jsonl"
    gone = json.dumps({**json.loads(_spec(16)), "name": f"{__name__}._no_such_kernel"})
    kp.write_atomic(todo, gone + "\n")
    kp.write_atomic(kept, gone + "\n")
    assert kp.main([str(kept), "--jobs", "1"]) == 0 and kept.exists()
    assert kp.main(["--todo", str(todo), "--jobs", "1"]) == 0 and not todo.exists()


def test_the_wait_removes_the_todo_list_and_its_exit_hook(caches, monkeypatch):
    import atexit

    registered, unregistered = [], []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(atexit, "unregister", unregistered.append)
    todo = caches / "todo.jsonl"
    todo.write_text("{}\n")

    class Done:
        returncode = 0

        def communicate(self, timeout=None):
            return '{"specs": 1}\n', None

    handle = kp.Precompile(Done(), [], todo)
    assert registered == [handle.remove_todo] and todo.exists()
    assert handle.wait()["specs"] == 1
    assert not todo.exists() and unregistered == [handle.remove_todo]
