"""Parallel precompile of the Triton kernels a start-up needs (startup chain: beside "load weights", issue 16).

Owns: the spec list — one Triton kernel specialisation per line, as Triton serialises it for
`JITFunction.preload` (name, signature, constexprs, attrs, options, target) — in `<cache>/triton_specs.jsonl`;
recording it (`SpecRecorder`: a `jit_post_compile_hook`, so every kernel the JIT compiled or loaded on a start,
and any compiled after Up, is on the next start's list); replaying it (`python -m dsaserve.engine.kernel_precompile
SPECS...`: worker processes compile each spec into Triton's on-disk cache, for the spec's target, no GPU
touched); and the handle the engine process starts first thing and waits on before its first forward
(`start`, `Precompile.wait`, `take_pending`).

Why: cold, the ~120 kernels of a start compiled one after another inside the memory profile, the graph capture
and the shape warmup (~36 s on the H200's host); on 16 cores in parallel they take a few seconds, while the
engine imports torch and loads weights. A list of a different code version is harmless: a spec whose kernel
changed compiles to an entry nobody reads, one whose kernel is gone fails in its worker and is counted.
`DSASERVE_KERNEL_SPECS` adds a list made elsewhere (install time, the device run); `DSASERVE_PRECOMPILE=0` is
the A/B switch. Only specs not known compiled are replayed (engine/compiled_specs.py): a warm start, whose
every spec an earlier start compiled or loaded, starts no process and waits on nothing. Module scope imports
only the standard library: the scheduler process starts this before torch.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import importlib
import json
import logging
import multiprocessing
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsaserve.common import envs
from dsaserve.common.envs import cache_root
from dsaserve.engine.compiled_specs import FILE as COMPILED_FILE
from dsaserve.engine.compiled_specs import CompiledSpecs, entry_of_hook, write_atomic

log = logging.getLogger(__name__)

SPECS_FILE = "triton_specs.jsonl"
WAIT_LIMIT_S = 300.0  # a stuck precompile must not hang start-up: the JIT then compiles what is left itself


def triton_cache_dir() -> Path:
    """Triton's on-disk cache: the user's TRITON_CACHE_DIR, else under the dsaserve cache (CompileCache sets it)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or cache_root() / "triton")


# Lists recorded on a device and shipped (extern library paths dropped): the first start on an empty cache has
# them too. Named <arch>-<config>; a list for another GPU or model only costs its workers' CPU time.
PACKAGED_SPECS = Path(__file__).with_name("kernel_specs")


def compiled_specs() -> CompiledSpecs:
    """Which specs this cache's Triton directory already holds (engine/compiled_specs.py)."""
    return CompiledSpecs(cache_root() / COMPILED_FILE, triton_cache_dir())


def first_local_rank() -> bool:
    """This process is its host's first rank ($LOCAL_RANK 0, or unset: one process). The ranks of one host share
    the cache directory; only this one writes the files all of them would write alike (the precompile, the
    compiled marks), so no rank's rename of a restamped file drops another's lines."""
    return int(os.environ.get("LOCAL_RANK", "0")) == 0


def spec_files() -> list[Path]:
    """The lists to replay: this cache's own, DSASERVE_KERNEL_SPECS (os.pathsep-separated), then the packaged
    ones; those present."""
    extra = [Path(p) for p in (envs.DSASERVE_KERNEL_SPECS or "").split(os.pathsep) if p]
    packaged = sorted(PACKAGED_SPECS.glob("*.jsonl")) if PACKAGED_SPECS.is_dir() else []
    return [p for p in [cache_root() / SPECS_FILE, *extra, *packaged] if p.is_file()]


def read_specs(paths: list[Path]) -> list[str]:
    """Every distinct spec line of the files, in order (a torn or foreign line is skipped)."""
    out: dict[str, None] = {}
    for path in paths:
        for line in path.read_text().splitlines():
            try:
                if isinstance(json.loads(line), dict):
                    out[line.strip()] = None
            except ValueError:
                continue
    return list(out)


def spec_name(spec: str) -> str:
    """The kernel a spec line names ('?' for a torn or foreign line)."""
    try:
        return str(json.loads(spec).get("name", "?"))
    except (ValueError, AttributeError):
        return "?"


def chain_post_compile_hook(on_load: Callable[[dict[str, Any]], None]) -> bool:
    """Call `on_load(kwargs)` each time a Triton JIT compiles or loads a kernel, before any hook installed
    earlier (which still runs); False without Triton's knobs (Triton < 3.4 or none): nothing is observed."""
    from dsaserve.kernels.jit_keys import chain_runtime_hook

    return chain_runtime_hook("jit_post_compile_hook", on_load)


class SpecRecorder:
    """Collects the serialised specialisation of every kernel the JIT compiles or loads (chained after any
    hook installed before), with the Triton cache entry it is in. `save()` merges them into the spec list and
    marks them compiled (engine/compiled_specs.py: the next start replays none of them); after it, each new one
    is appended and marked at once (a kernel compiled after Up is on the next start's list). Only the host's first
    rank marks (`first_local_rank`): the others' lists are saved, and a kernel only they loaded is replayed once by
    the next start's precompile, which marks it then."""

    def __init__(self, path: Path | None = None, compiled: CompiledSpecs | None = None) -> None:
        self.path = path or cache_root() / SPECS_FILE
        # the cache's own mark file by default (the host's first rank only); a recorder of another list (tests)
        # marks only where told
        if compiled is None and path is None and first_local_rank():
            compiled = compiled_specs()
        self.compiled = compiled
        self.specs: dict[str, str | None] = {}  # spec line -> its Triton cache entry (None: not known)
        self.mirrors: list[Path] = []  # more lists a spec seen after save() is appended to (engine/warm_start.py)
        self.saved = False
        self.append_failed = False  # one warning for the first failed append, not one per kernel
        self.installed = chain_post_compile_hook(
            lambda kw: self.add((kw.get("compile") or {}).get("specialization_data"), entry_of_hook(kw)))

    def add(self, spec: str | None, entry: str | None = None) -> None:
        if not spec or spec in self.specs:
            return
        self.specs[spec] = entry
        if self.saved:
            for path in (self.path, *self.mirrors):
                self._append(path, spec)
            self._mark({spec: entry})

    def _append(self, path: Path, spec: str) -> None:
        """Best effort: this runs inside a kernel launch, where a full disk or a read-only cache must not fail
        the step (the spec stays in `specs`; the next start just compiles that kernel itself)."""
        try:
            with open(path, "a") as f:
                f.write(spec + "\n")
        except OSError as e:
            if not self.append_failed:
                self.append_failed = True
                log.warning("kernel spec not appended to %s (further failures not logged): %s", path, e)

    def _mark(self, specs: dict[str, str | None]) -> None:
        """Specs whose cache entry is known marked compiled (one of unknown entry is left to the replay)."""
        known = {s: e for s, e in specs.items() if e is not None}
        if self.compiled is not None and known:
            with contextlib.suppress(OSError):  # the next start replays them: slower, not wrong
                self.compiled.mark(known)

    def save(self) -> int:
        """The recorded specs merged into the list on disk (atomically) and marked compiled; how many lines
        the list now has."""
        lines = read_specs([self.path] if self.path.is_file() else []) + list(self.specs)
        lines = list(dict.fromkeys(lines))
        write_atomic(self.path, "".join(line + "\n" for line in lines))
        self.saved = True
        self._mark(self.specs)
        return len(lines)


# ---- replay (the precompile process) ---------------------------------------------------------------
def resolve_jit(full_name: str) -> Any:
    """'pkg.module.Class.kernel' -> the JITFunction: the longest importable module prefix, then attributes."""
    parts = full_name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"no importable module in {full_name!r}")


def _constant(value: Any) -> Any:
    """A constexpr value as `serialize_specialization_data` wrote it, back to what the JIT passed."""
    import triton.language as tl

    if isinstance(value, str) and tl.dtype.is_dtype(value):
        return tl.dtype(value)
    if isinstance(value, dict) and "constexpr" in value:
        return tl.constexpr(_tuples(value["constexpr"]))
    if isinstance(value, dict) and "jit_function" in value:
        module, qualname = value["jit_function"].split(":")
        return resolve_jit(f"{module}.{qualname}")
    return _tuples(value)


def _tuples(v: Any) -> Any:
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def compile_spec(spec: str) -> str | None:
    """Compile one spec into Triton's disk cache (a hit there just loads it); None, or the error."""
    return replay_spec(spec)[1]


def compiled_kernel(spec: str) -> Any:
    """The spec's kernel compiled for its target with its signature, constexprs, attributes and options (Triton's
    disk cache holds it after; a hit there just loads it); raises what the compile raises."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    d = json.loads(spec)
    fn = resolve_jit(d["name"])
    constexprs = {tuple(k): _constant(v) for k, v in zip(d["constant_keys"], d["constant_vals"], strict=True)}
    attrs = {tuple(k): v for k, v in zip(d["attrs_keys"], d["attrs_vals"], strict=True)}
    signature = {k: _tuples(v) for k, v in d["signature"].items()}
    # extern library paths are the recording machine's; left out, the backend puts this install's default
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in d["options"].items() if k != "extern_libs"}
    source = ASTSource
    if getattr(fn, "is_gluon", lambda: False)():  # kernels/gluon_*.py (its JIT sets its source at first launch)
        from triton.experimental.gluon._runtime import GluonASTSource as source
    return triton.compile(source(fn, signature, constexprs, attrs), target=_target(d, GPUTarget), options=options)


def replay_spec(spec: str) -> tuple[str | None, str | None]:
    """Compile one spec into Triton's disk cache; (the cache entry it is in, None) or (None, the error)."""
    try:
        return str(compiled_kernel(spec).hash), None
    except Exception as e:  # one bad spec must not stop the others
        return None, f"{spec_name(spec)}: {type(e).__name__}: {e}"[:300]


def _target(d: dict[str, Any], gpu_target: Any) -> Any:
    """The spec's GPUTarget: Triton 3.9 writes it; 3.6 (the H200's) only has the options' backend / arch / warps
    (a spec without it failed with KeyError 'target' on the H200, every one of 93)."""
    if "target" in d:
        return gpu_target(**d["target"])
    opts = d["options"]
    arch = str(opts["arch"])
    return gpu_target(opts.get("backend_name", "cuda"), int(arch[2:]) if arch.startswith("sm") else arch,
                      opts.get("warp_size", 32))


def _prime(fn: Any) -> None:
    """The kernel's cache key as the engine's JIT computes it (kernels/jit_keys.py: callees first)."""
    from dsaserve.kernels.jit_keys import prime

    prime(fn)


def _entries(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()} if path.is_dir() else set()


def precompile(specs: list[str], jobs: int, compiled: CompiledSpecs | None = None) -> dict[str, Any]:
    """Compile every spec on `jobs` forked workers; what happened (entries made = kernels compiled now).
    `compiled`: where each spec's outcome is marked (its entry; a failed one too: it is not retried)."""
    t0 = time.perf_counter()
    before = _entries(triton_cache_dir())
    for spec in specs:  # imported and keyed before the fork: each worker starts with the kernels' modules loaded
        with contextlib.suppress(Exception):  # its worker reports it
            _prime(resolve_jit(json.loads(spec)["name"]))
    with contextlib.suppress(Exception):  # Triton's version hash (~400 MB of libtriton.so) once, not per worker
        from triton.runtime.cache import triton_key

        triton_key()
    if jobs <= 1 or len(specs) <= 1:
        results = list(map(replay_spec, specs))
    else:
        ctx = multiprocessing.get_context("fork")  # nothing in this process touched a GPU
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=ctx) as pool:
            results = list(pool.map(replay_spec, specs))
    errors = [e for _, e in results if e]
    if compiled is not None:
        with contextlib.suppress(OSError):  # an unwritable cache: the next start replays them again
            compiled.mark({s: entry for s, (entry, _) in zip(specs, results, strict=True)})
    return {"specs": len(specs), "compiled": len(_entries(triton_cache_dir()) - before), "failed": len(errors),
            "errors": errors[:5], "jobs": jobs, "seconds": round(time.perf_counter() - t0, 3)}


def default_jobs() -> int:
    """All cores but one (the engine loads weights meanwhile)."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, n - 1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="compile recorded Triton kernel specs into Triton's disk cache")
    ap.add_argument("specs", nargs="+", type=Path)
    ap.add_argument("--jobs", type=int, default=default_jobs())
    ap.add_argument("--parent-pid", type=int, default=None)
    ap.add_argument("--todo", action="store_true", help="the lists are the parent's todo list: removed once read")
    a = ap.parse_args(argv)
    if a.parent_pid is not None:
        from dsaserve.engine.lifetime import die_with_parent

        die_with_parent(a.parent_pid)
    specs = read_specs(a.specs)
    if a.todo:  # read: nothing else needs it, whatever happens to the parent from here on
        for path in a.specs:
            with contextlib.suppress(OSError):
                path.unlink()
    print(json.dumps(precompile(specs, a.jobs, compiled_specs())), flush=True)
    return 0


# ---- the engine's handle ------------------------------------------------------------------------------
class Precompile:
    """A running precompile process (started by this process, so it dies with it)."""

    def __init__(self, proc: subprocess.Popen, files: list[Path], todo: Path | None = None) -> None:
        self.proc, self.files, self.todo, self.t0 = proc, files, todo, time.perf_counter()
        self.report: dict[str, Any] | None = None
        self.known = 0  # the lists' specs left out: known compiled already (engine/compiled_specs.py)
        if todo is not None:  # a start that fails before its wait: removed at exit (the process may never read it)
            atexit.register(self.remove_todo)

    def remove_todo(self) -> None:
        """The todo list handed to the process removed (the process removes it once read; this covers a process
        that never got so far): after the wait, or at this process's exit when no wait came."""
        if self.todo is not None:
            with contextlib.suppress(OSError):
                self.todo.unlink()
            atexit.unregister(self.remove_todo)

    def wait(self, limit_s: float = WAIT_LIMIT_S) -> dict[str, Any]:
        """Blocks until it is done (at most `limit_s`: then it is stopped); its report, with `wall_s` (its
        time from start, overlapped with the engine's own phases) and `waited_s` (what the caller waited)."""
        if self.report is not None:
            return self.report
        t = time.perf_counter()
        try:
            out, _ = self.proc.communicate(timeout=limit_s)
            lines = [ln for ln in (out or "").splitlines() if ln.startswith("{")]
            self.report = json.loads(lines[-1]) if lines else {"error": f"exit code {self.proc.returncode}"}
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            self.report = {"error": f"not done in {limit_s:g} s: stopped"}
        self.report.update(wall_s=round(time.perf_counter() - self.t0, 3), known_compiled=self.known,
                           waited_s=round(time.perf_counter() - t, 3), lists=[str(p) for p in self.files])
        self.remove_todo()
        return self.report


_pending: Precompile | None = None
_skipped: dict[str, Any] | None = None  # why the last start() started no process, when the lists had specs


def start() -> Precompile | None:
    """Start the precompile of the recorded lists' specs not known compiled in this cache (None: switched off,
    nothing recorded yet, every spec already compiled by an earlier start (`skipped()` says so), or not the
    node's first rank: ranks of one node share the disk cache). Remembered for `take_pending`."""
    global _pending, _skipped
    if _pending is not None:
        return _pending
    files = spec_files()
    if not envs.DSASERVE_PRECOMPILE or not files or not first_local_rank():
        return None
    t0 = time.perf_counter()
    specs = read_specs(files)
    todo = compiled_specs().pending(specs)
    if not todo:
        _skipped = {"status": "skipped: every spec already compiled", "specs": len(specs), "compiled": 0,
                    "check_s": round(time.perf_counter() - t0, 4), "lists": [str(p) for p in files]}
        return None
    todo_file: Path | None = cache_root() / f"precompile_todo.{os.getpid()}.jsonl"
    try:
        write_atomic(todo_file, "".join(line + "\n" for line in todo))
    except OSError:  # an unwritable cache: replay the whole lists (their compiles fail to land the same way)
        todo_file, todo = None, specs
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache_dir())}
    cmd = [sys.executable, "-m", "dsaserve.engine.kernel_precompile", "--parent-pid", str(os.getpid()),
           *(["--todo", str(todo_file)] if todo_file is not None else map(str, files))]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
    except OSError:
        if todo_file is not None:
            todo_file.unlink(missing_ok=True)
        raise
    _pending = Precompile(proc, files, todo_file)
    _pending.known = len(specs) - len(todo)
    return _pending


def skipped() -> dict[str, Any] | None:
    """The report of a start() that found every spec compiled already (None: it did not)."""
    return _skipped


def take_pending() -> Precompile | None:
    """The precompile this process started, if any (the engine waits for it before its first forward)."""
    return _pending


if __name__ == "__main__":
    sys.exit(main())
