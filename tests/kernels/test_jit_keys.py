"""kernels/jit_keys.py: every dsaserve Triton kernel's cache key includes the constexpr globals of everything it
calls, and the keys do not depend on the order they were computed in (fresh processes, opposite orders).
Also run under the H200's Triton 3.6, where the JIT alone gets this wrong:
`PYTHONPATH=/work/t36:. python -m pytest tests/kernels/test_jit_keys.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_KEYS = """
import json, sys
from dsaserve.kernels import jit_keys
if sys.argv[1] == "reverse":  # leaves first as well, but every module and function in the opposite order
    import importlib, pkgutil
    import dsaserve.kernels as pkg
    mods = [importlib.import_module(f"dsaserve.kernels.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)
            if m.name.startswith("triton_")]
    seen = set()
    for mod in reversed(sorted(mods, key=lambda m: m.__name__)):
        for fn in reversed(jit_keys._jit_functions(mod)):
            jit_keys._prime(fn, seen)
jit_keys.stable_cache_keys()
mods = [m for m in sorted(sys.modules) if m.startswith("dsaserve.kernels.triton_")]
out = {f"{fn.__module__}.{fn.__name__}": fn.cache_key for m in mods for fn in jit_keys._jit_functions(sys.modules[m])}
print(json.dumps(out))
"""


def _keys(order: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _KEYS, order], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_keys_do_not_depend_on_the_order():
    forward, reverse = _keys("forward"), _keys("reverse")
    assert len(forward) > 50 and forward == reverse


def test_a_callers_key_covers_its_callees_globals():
    from dsaserve.kernels import jit_keys
    from dsaserve.kernels import triton_fp8_gemm as g

    assert jit_keys.stable_cache_keys() > 50
    checked = 0
    for name in sorted(n for n in sys.modules if n.startswith("dsaserve.kernels.triton_")):
        for fn in jit_keys._jit_functions(sys.modules[name]):
            # triton.language's own functions (tl.sort, ...) are Triton's, covered by its version in every key
            for callee in (c for c in jit_keys._callees(fn) if c.__module__.startswith("dsaserve.")):
                assert set(callee.used_global_vals) <= set(fn.used_global_vals), (fn.__name__, callee.__name__)
                checked += 1
    assert checked > 10
    # the case found on the H200's Triton: the activation quantiser's clamp constant, through quant_rows_fp8
    assert g.quant_rows_fp8 in jit_keys._callees(g._quant_group_kernel)
    assert any(name == "FP8_MAX_C" for name, _ in g._quant_group_kernel.used_global_vals)
