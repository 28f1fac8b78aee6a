"""Triton JIT cache keys that do not depend on the order kernels are first compiled in a process.

Owns: `prime(fn)`, which computes the cache key of a JIT function's callees before its own; the compile hook
that primes every kernel the JIT is about to compile (`install_compile_hook`, installed by the registry before
the GPU ops' first launch); `chain_runtime_hook`, which puts a callable before any hook in one of Triton's
runtime knobs (the spec recorder's and the kernel-load counter's too); and `stable_cache_keys()`, every
dsaserve kernel primed at once (tests). The
precompile and the warm-start preload prime each spec's kernel before compiling it, so all three name a
kernel's disk-cache entry alike.

Why: Triton 3.6 (the H200's) merges a callee's constexpr globals into its caller's key from the callee's
`used_global_vals`, which is filled only once the callee's own key was computed; the merge happens before it
is (runtime/jit.py `DependenciesFinder._update_hash`). So `_quant_group_kernel` (which calls `quant_rows_fp8`,
which reads the global `FP8_MAX_C`) hashes one way when `quant_rows_fp8`'s key was computed earlier in the
process and another when not: a precompile worker compiled some RMSNorm / SiLU / activation-quant specs to
entries the engine's JIT never read (7 of the 99 shipped specs on a second replay into the same cache, on
the CPU under 3.6), and the JIT compiled them again. Computed leaves first, every key includes every global
it reads, whatever the process did before. Triton 3.9 computes the callee's key first itself; this then
only computes the keys a little earlier.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import dsaserve.kernels as _pkg


def _jit_functions(module: ModuleType) -> list[Any]:
    from triton.runtime.jit import JITFunction

    out = []
    for value in vars(module).values():
        while not isinstance(value, JITFunction) and hasattr(value, "fn"):  # autotuner / heuristics wrappers
            value = value.fn
        if isinstance(value, JITFunction) and value.__module__ == module.__name__:
            out.append(value)
    return out


def _callees(fn: Any) -> list[Any]:
    """The JIT functions `fn`'s body names: globals (`f(...)`) and attributes of imported modules (`m.f(...)`)."""
    from triton.runtime.jit import JITFunction

    code, glob = fn.fn.__code__, fn.fn.__globals__
    names = set(code.co_names)
    found = []
    for name in names:
        value = glob.get(name)
        if isinstance(value, JITFunction):
            found.append(value)
        elif isinstance(value, ModuleType):
            found.extend(v for n in names if isinstance(v := getattr(value, n, None), JITFunction))
    return found


def _prime(fn: Any, seen: set[int]) -> None:
    if id(fn) in seen:
        return
    seen.add(id(fn))
    for callee in _callees(fn):
        _prime(callee, seen)
    _ = fn.cache_key  # memoised by Triton: every later compile or preload reads this one


def prime(fn: Any) -> None:
    """`fn`'s cache key (a JITFunction, or an autotuner / heuristics wrapper of one) computed callees first."""
    from triton.runtime.jit import JITFunction

    while not isinstance(fn, JITFunction) and hasattr(fn, "fn"):
        fn = fn.fn
    if isinstance(fn, JITFunction):
        _prime(fn, set())


_installed = False


def install_compile_hook() -> bool:
    """Prime each kernel the JIT is about to compile or load (its `jit_cache_hook` runs before the key is
    computed), before any hook installed earlier, which still decides; False without Triton's knobs."""
    global _installed
    if _installed:
        return True

    def before(kwargs: dict[str, Any]) -> None:
        info = kwargs.get("fn")
        if info is not None and hasattr(info, "jit_function"):
            prime(info.jit_function)

    _installed = chain_runtime_hook("jit_cache_hook", before)
    return _installed


def chain_runtime_hook(knob: str, before: Callable[[dict[str, Any]], None]) -> bool:
    """Triton's runtime hook `knob` (`jit_cache_hook`, `jit_post_compile_hook`) made to call `before(kwargs)`
    first, then any hook installed earlier (whose result is returned); False without Triton's knobs (< 3.4)."""
    try:
        from triton import knobs

        previous = getattr(knobs.runtime, knob)
    except (ImportError, AttributeError):
        return False

    def hook(*args: Any, **kwargs: Any) -> Any:
        before(kwargs)
        return previous(*args, **kwargs) if previous is not None else None

    setattr(knobs.runtime, knob, hook)
    return True


def stable_cache_keys() -> int:
    """Every dsaserve Triton kernel's cache key computed callees first (idempotent: keys are memoised); how
    many JIT functions that covered. 0 without Triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return 0
    for info in pkgutil.iter_modules(_pkg.__path__):
        if info.name.startswith("triton_"):
            importlib.import_module(f"{_pkg.__name__}.{info.name}")
    seen: set[int] = set()
    prefix = f"{_pkg.__name__}.triton_"
    for name in sorted(n for n in sys.modules if n.startswith(prefix)):
        for fn in _jit_functions(sys.modules[name]):
            _prime(fn, seen)
    return len(seen)
