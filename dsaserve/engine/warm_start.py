"""Warm start: what an earlier start of the same configuration recorded, reused (issue 16: "<= 5 s warm").

Owns: the record of one configuration in `<cache>/warm_start/<fingerprint>/` — `specs.jsonl`, every Triton
kernel specialisation that configuration's process held in its JITs at Up (and any it loaded after), and
`memory_profile.json`, its memory profile; the fingerprint (everything that decides which kernels a start
loads and what the profile measures: engine arguments, model config, the switches set, this rank's place, GPU
name and memory, torch / Triton / CUDA versions, dsaserve's own source); `preload`, which puts the recorded
specs straight into each JITFunction's in-memory cache (Triton's `JITFunction.preload`, then the kernel's
module and launcher loaded as its first launch would); and what the manifest says of both (hit / miss).
Also `prewarm_triton_key`: the one per-process hash Triton computes before its first kernel, off the path.

Why: on a warm start every kernel is already in Triton's disk cache. What the shape warmup still cost (5.1 s
of a 13.1 s warm start on the H200) is Triton's per-process work (binaries loaded, launchers built) and the
~529 forwards run only to trigger it; the memory profile (1.2 s) measures what the same configuration measured
before. Correctness: a record is written only by a start that reached Up with its graphs captured; the forward
shape warmup is reduced only when every recorded spec preloaded and nothing compiled or loaded between the
preload and the warmup (`covers`); a cached profile is used only then too. Otherwise (no record: the cold
path; a stale or partial one) the forwards run as before and the record is rewritten at Up.
`DSASERVE_WARM_START=0` is the A/B switch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from dsaserve.common import envs
from dsaserve.engine.compiled_specs import code_version
from dsaserve.engine.kernel_precompile import read_specs, resolve_jit, spec_name, write_atomic

log = logging.getLogger(__name__)

RECORD_DIR = "warm_start"
SPECS = "specs.jsonl"
PROFILE = "memory_profile.json"
# switches that change where caches are or how a start runs, not which kernels it loads or what it measures
START_ONLY_SWITCHES = frozenset({"DSASERVE_CACHE_DIR", "DSASERVE_KERNEL_SPECS", "DSASERVE_PRECOMPILE",
                                 "DSASERVE_WARM_START", "DSASERVE_TEST_READY_DELAY_S", "DSASERVE_EARLY_CUDA",
                                 "DSASERVE_STARTUP_PROFILE"})
# engine arguments of the rendezvous only (a free port chosen per start would make every start a miss)
START_ONLY_ARGS = frozenset({"dist_init_addr", "dist_timeout", "grammar_compile_timeout"})


def fingerprint(parts: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()[:20]


def config_parts(args: Any, cfg: Any, parallel: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """The configuration's part of the fingerprint: engine arguments (less the rendezvous), the model config,
    the switches set (less start-up-only ones), this rank's place, dsaserve's source; `extra` adds the rest."""
    a = {k: v for k, v in dataclasses.asdict(args).items() if k not in START_ONLY_ARGS}
    switches = {k: v for k, v in envs.set_switches().items() if k not in START_ONLY_SWITCHES}
    return {"args": a, "model": dataclasses.asdict(cfg), "switches": switches, "parallel": parallel,
            "code": code_version(), **extra}


def device_parts(device: Any) -> dict[str, Any]:
    """The GPU and the software stack: a record made on another GPU, driver stack or version is not this one's."""
    import torch

    parts: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        parts["triton"] = triton.__version__
    except ImportError:
        parts["triton"] = None
    if getattr(device, "type", str(device)) == "cuda" or str(device).startswith("cuda"):
        p = torch.cuda.get_device_properties(device)
        parts.update(gpu=p.name, capability=[p.major, p.minor], total_memory=p.total_memory)
    return parts


_key_thread: threading.Thread | None = None


def prewarm_triton_key() -> threading.Thread | None:
    """Triton's own version hash (`triton_key`: sha256 of its sources and the ~400 MB libtriton.so, ~1 s of one
    core here, once per process, before the first kernel of any start compiles or loads) computed on a thread;
    hashlib lets go of the GIL on each 1 MB chunk. A scheduler process starts it first thing, beside torch's
    import; later calls return the same thread. None: no Triton."""
    global _key_thread
    if _key_thread is None:
        try:
            from triton.runtime.cache import triton_key
        except ImportError:
            return None
        _key_thread = threading.Thread(target=triton_key, name="triton-key", daemon=True)
        _key_thread.start()
    return _key_thread


def _await_triton_key() -> None:
    """The preload's first cache key needs the hash: wait for the thread rather than compute it a second time
    beside it (Triton's lru_cache does not hold concurrent callers back)."""
    if _key_thread is not None:
        _key_thread.join()


def preload_spec(spec: str) -> str | None:
    """One spec into its JITFunction's in-memory cache, its binary and launcher loaded; None, or the error."""
    try:
        from dsaserve.kernels.jit_keys import prime

        fn = resolve_jit(json.loads(spec)["name"])
        while not hasattr(fn, "preload") and hasattr(fn, "fn"):  # a wrapper (autotuner, heuristics)
            fn = fn.fn
        prime(fn)  # its key as the precompile and the JIT compute it (kernels/jit_keys.py)
        kernel = fn.preload(spec)
        if kernel is None:
            return f"{spec_name(spec)}: not loaded (a JIT cache hook declined it)"
        if hasattr(kernel, "result"):  # Triton's async compile mode hands back a future
            kernel = kernel.result()
        kernel._init_handles()  # the module load and the launcher: what its first launch would do
        return None
    except Exception as e:  # one stale spec must not stop the others: the forward warmup covers it
        return f"{spec_name(spec)}: {type(e).__name__}: {e}"[:300]


class WarmStart:
    """The record of one configuration (its fingerprint's directory) and what this start did with it."""

    def __init__(self, parts: dict[str, Any], root: Path | None = None) -> None:
        self.key = fingerprint(parts)
        self.dir = (root or envs.cache_root()) / RECORD_DIR / self.key
        self.enabled = envs.DSASERVE_WARM_START
        self.preload_report: dict[str, Any] = {"status": "off" if not self.enabled else "not run"}
        self.profile_status = "off" if not self.enabled else "miss"
        self.loads_after_preload: int | None = None  # the JITs' load count when the preload ended

    @property
    def specs_path(self) -> Path:
        return self.dir / SPECS

    @property
    def profile_path(self) -> Path:
        return self.dir / PROFILE

    def preload(self, loads: Callable[[], int | None]) -> dict[str, Any]:
        """Every recorded spec preloaded. status "hit" (all of them), "partial" (some failed: listed),
        "miss" (no record for this fingerprint), "off" (DSASERVE_WARM_START=0). `loads()`: the JITs' load
        count (KernelLoads), read when done, so `covers` can tell whether anything loaded after the preload."""
        if not self.enabled:
            return self.preload_report
        t0 = time.perf_counter()
        specs = read_specs([self.specs_path]) if self.specs_path.is_file() else []
        if not specs:
            self.preload_report = {"status": "miss", "key": self.key}
            return self.preload_report
        _await_triton_key()
        errors = [e for e in map(preload_spec, specs) if e]
        self.preload_report = {"status": "partial" if errors else "hit", "key": self.key, "specs": len(specs),
                               "failed": len(errors), "errors": errors[:5],
                               "seconds": round(time.perf_counter() - t0, 3)}
        if errors:
            log.warning("warm start: %d of %d recorded kernel specs did not preload (first: %s); the forward "
                        "warmup runs", len(errors), len(specs), errors[0])
        self.loads_after_preload = loads()
        return self.preload_report

    def covers(self, loads_now: int | None) -> bool:
        """Whether the preload had every kernel this start has needed since: all specs preloaded, and the JITs
        loaded none after it (an unknown count is not proof)."""
        ok = (self.preload_report.get("status") == "hit" and loads_now is not None
              and self.loads_after_preload is not None and loads_now == self.loads_after_preload)
        self.preload_report["covered_warmup"] = ok
        if self.preload_report.get("status") == "hit" and not ok:
            self.preload_report["loaded_after_preload"] = (None if loads_now is None or self.loads_after_preload is None
                                                           else loads_now - self.loads_after_preload)
        return ok

    # ---- the memory profile ---------------------------------------------------------------------
    def cached_profile(self, live: dict[str, Any]) -> dict[str, Any] | None:
        """The recorded profile if this start may use it: the preload was a hit (the profile's forwards would
        have loaded nothing) and every `live` value (total memory, weights, fraction, reserve) is the same."""
        if not self.enabled or self.preload_report.get("status") != "hit" or not self.profile_path.is_file():
            return None
        try:
            cached = json.loads(self.profile_path.read_text())
        except (OSError, ValueError):
            return None
        changed = [k for k, v in live.items() if not isinstance(cached, dict) or cached.get(k) != v]
        if changed:
            self.profile_status = f"miss (changed: {', '.join(changed)})"
            return None
        self.profile_status = "hit"
        return cached

    # ---- writing the record ---------------------------------------------------------------------
    def save(self, specs: Iterable[str], profile: dict[str, Any] | None) -> bool:
        """The record rewritten (atomically) when this start's specs or profile differ from it; whether it was.
        Called at Up, only by a start whose graphs were all captured."""
        if not self.enabled:
            return False
        specs = list(dict.fromkeys(specs))  # this start's own: a stale spec of the old record is dropped
        wrote = False
        old = read_specs([self.specs_path]) if self.specs_path.is_file() else []
        if specs and set(specs) != set(old):
            write_atomic(self.specs_path, "".join(s + "\n" for s in specs))
            wrote = True
        if profile is not None and self.profile_status != "hit":
            write_atomic(self.profile_path, json.dumps(profile, sort_keys=True))
            wrote = True
        return wrote

    def report(self) -> dict[str, Any]:
        return {"status": self.preload_report.get("status"), "dir": str(self.dir),
                "preload": self.preload_report, "memory_profile": self.profile_status}
