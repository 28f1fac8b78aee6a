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
the A/B switch. Module scope imports only the standard library: the scheduler process starts this before torch.
"""

from __future__ import annotations

import argparse
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

log = logging.getLogger(__name__)

SPECS_FILE = "triton_specs.jsonl"
WAIT_LIMIT_S = 300.0  # a stuck precompile must not hang start-up: the JIT then compiles what is left itself


def cache_root() -> Path:
    return Path(envs.DSASERVE_CACHE_DIR or "~/.cache/dsaserve").expanduser()


def triton_cache_dir() -> Path:
    """Triton's on-disk cache: the user's TRITON_CACHE_DIR, else under the dsaserve cache (CompileCache sets it)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or cache_root() / "triton")


# Lists recorded on a device and shipped (extern library paths dropped): the first start on an empty cache has
# them too. Named <arch>-<config>; a list for another GPU or model only costs its workers' CPU time.
PACKAGED_SPECS = Path(__file__).with_name("kernel_specs")


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


def write_atomic(path: Path, text: str) -> None:
    """`text` to `path` through a temporary file and a rename: a reader never sees half a list."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def chain_post_compile_hook(on_load: Callable[[dict[str, Any]], None]) -> bool:
    """Call `on_load(kwargs)` each time a Triton JIT compiles or loads a kernel, before any hook installed
    earlier (which still runs); False without Triton's knobs (Triton < 3.4 or none): nothing is observed."""
    try:
        from triton import knobs

        previous = knobs.runtime.jit_post_compile_hook
    except (ImportError, AttributeError):
        return False

    def hook(*args: Any, **kwargs: Any) -> Any:
        on_load(kwargs)
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    return True


class SpecRecorder:
    """Collects the serialised specialisation of every kernel the JIT compiles or loads (chained after any
    hook installed before). `save()` merges them into the spec list; after it, each new one is appended at
    once (a kernel compiled after Up is on the next start's list)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or cache_root() / SPECS_FILE
        self.specs: dict[str, None] = {}
        self.mirrors: list[Path] = []  # more lists a spec seen after save() is appended to (engine/warm_start.py)
        self.saved = False
        self.append_failed = False  # one warning for the first failed append, not one per kernel
        self.installed = chain_post_compile_hook(
            lambda kw: self.add((kw.get("compile") or {}).get("specialization_data")))

    def add(self, spec: str | None) -> None:
        if not spec or spec in self.specs:
            return
        self.specs[spec] = None
        if self.saved:
            for path in (self.path, *self.mirrors):
                self._append(path, spec)

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

    def save(self) -> int:
        """The recorded specs merged into the list on disk (atomically); how many lines it now has."""
        lines = read_specs([self.path] if self.path.is_file() else []) + list(self.specs)
        lines = list(dict.fromkeys(lines))
        write_atomic(self.path, "".join(line + "\n" for line in lines))
        self.saved = True
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
    try:
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
        triton.compile(ASTSource(fn, signature, constexprs, attrs), target=_target(d, GPUTarget), options=options)
        return None
    except Exception as e:  # one bad spec must not stop the others
        return f"{spec_name(spec)}: {type(e).__name__}: {e}"[:300]


def _target(d: dict[str, Any], gpu_target: Any) -> Any:
    """The spec's GPUTarget: Triton 3.9 writes it; 3.6 (the H200's) only has the options' backend / arch / warps
    (a spec without it failed with KeyError 'target' on the H200, every one of 93)."""
    if "target" in d:
        return gpu_target(**d["target"])
    opts = d["options"]
    arch = str(opts["arch"])
    return gpu_target(opts.get("backend_name", "cuda"), int(arch[2:]) if arch.startswith("sm") else arch,
                      opts.get("warp_size", 32))


def _entries(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()} if path.is_dir() else set()


def precompile(specs: list[str], jobs: int) -> dict[str, Any]:
    """Compile every spec on `jobs` forked workers; what happened (entries made = kernels compiled now)."""
    t0 = time.perf_counter()
    before = _entries(triton_cache_dir())
    for spec in specs:  # imported before the fork: each worker starts with the kernels' modules loaded
        with contextlib.suppress(Exception):  # its worker reports it
            resolve_jit(json.loads(spec)["name"])
    with contextlib.suppress(Exception):  # Triton's version hash (~400 MB of libtriton.so) once, not per worker
        from triton.runtime.cache import triton_key

        triton_key()
    errors: list[str] = []
    if jobs <= 1 or len(specs) <= 1:
        errors = [e for e in map(compile_spec, specs) if e]
    else:
        ctx = multiprocessing.get_context("fork")  # nothing in this process touched a GPU
        with concurrent.futures.ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=ctx) as pool:
            errors = [e for e in pool.map(compile_spec, specs) if e]
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
    a = ap.parse_args(argv)
    if a.parent_pid is not None:
        from dsaserve.engine.lifetime import die_with_parent

        die_with_parent(a.parent_pid)
    print(json.dumps(precompile(read_specs(a.specs), a.jobs)), flush=True)
    return 0


# ---- the engine's handle ------------------------------------------------------------------------------
class Precompile:
    """A running precompile process (started by this process, so it dies with it)."""

    def __init__(self, proc: subprocess.Popen, files: list[Path]) -> None:
        self.proc, self.files, self.t0 = proc, files, time.perf_counter()
        self.report: dict[str, Any] | None = None

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
        self.report.update(wall_s=round(time.perf_counter() - self.t0, 3),
                           waited_s=round(time.perf_counter() - t, 3), lists=[str(p) for p in self.files])
        return self.report


_pending: Precompile | None = None


def start() -> Precompile | None:
    """Start the precompile of the recorded lists (None: switched off, nothing recorded yet, or not the node's
    first rank: ranks of one node share the disk cache). Remembered for `take_pending`."""
    global _pending
    if _pending is not None:
        return _pending
    files = spec_files()
    if not envs.DSASERVE_PRECOMPILE or not files or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    env = {**os.environ, "TRITON_CACHE_DIR": str(triton_cache_dir())}
    cmd = [sys.executable, "-m", "dsaserve.engine.kernel_precompile", "--parent-pid", str(os.getpid()),
           *map(str, files)]
    _pending = Precompile(subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                           env=env), files)
    return _pending


def take_pending() -> Precompile | None:
    """The precompile this process started, if any (the engine waits for it before its first forward)."""
    return _pending


if __name__ == "__main__":
    sys.exit(main())
