"""engine/warm_start.py's preload on the real Triton JIT, without a GPU: a driver stand-in (tests/offline_triton.py)
gives the JIT an sm_90 target, so a launch with `warmup=True` compiles offline (no kernel runs) and the module load
is stubbed. What it checks is what the warm start rests on: the spec the JIT's hook recorded, preloaded into a
fresh JIT (a new process's), is found by the next launch of the same specialisation (no compile, no load: the hook
is not called again), while another specialisation still goes through the JIT; a stale spec is an error, not a
raise. Also runs under the H200's Triton 3.6: `PYTHONPATH=/work/t36:. python -m pytest <this file>`."""

from __future__ import annotations

import json

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.compiler import CompiledKernel  # noqa: E402
from triton.runtime import driver  # noqa: E402

from dsaserve.engine import warm_start as ws  # noqa: E402
from dsaserve.engine.compiled_specs import CompiledSpecs, entry_dirs  # noqa: E402
from dsaserve.engine.kernel_precompile import SpecRecorder  # noqa: E402
from dsaserve.engine.warmup import KernelLoads  # noqa: E402
from tests.offline_triton import Sm90Driver  # noqa: E402


@triton.jit
def _copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.fixture
def jit(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    handles = []
    monkeypatch.setattr(CompiledKernel, "_init_handles", lambda self: handles.append(self.name))
    previous = triton.knobs.runtime.jit_post_compile_hook
    monkeypatch.setattr(driver, "_active", Sm90Driver())
    _copy_kernel.device_caches.clear()
    try:
        yield handles
    finally:
        _copy_kernel.device_caches.clear()
        triton.knobs.runtime.jit_post_compile_hook = previous


def test_a_preloaded_spec_is_the_next_launchs_jit_cache_hit(jit, tmp_path):
    loads, recorder = KernelLoads(), SpecRecorder(tmp_path / "specs.jsonl")
    x, y = torch.zeros(64), torch.zeros(64)
    _copy_kernel.warmup(x, y, 64, BLOCK=64, grid=(1,))  # the recording start: compiled (offline, sm_90)
    assert loads.count == 1 and len(recorder.specs) == 1
    spec = next(iter(recorder.specs))

    _copy_kernel.device_caches.clear()  # the next start's JIT: empty in memory, the disk cache warm
    assert ws.preload_spec(spec) is None
    assert loads.count == 2 and jit == ["_copy_kernel"]  # loaded, and its module and launcher with it
    _copy_kernel.warmup(x, y, 64, BLOCK=64, grid=(1,))
    assert loads.count == 2  # the launch found it: nothing compiled or loaded after the preload
    _copy_kernel.warmup(x, y, 63, BLOCK=64, grid=(1,))  # n not divisible by 16: another specialisation
    assert loads.count == 3
    stale = json.loads(spec)
    stale["signature"]["x_ptr"] = "*nonsense"  # a kernel whose arguments changed since the record
    assert ws.preload_spec(json.dumps(stale)).startswith(f"{__name__}._copy_kernel: ")


def test_a_kernel_loaded_after_up_is_logged_by_name(jit, caplog):
    loads = KernelLoads()
    x, y = torch.zeros(64), torch.zeros(64)
    _copy_kernel.warmup(x, y, 64, BLOCK=64, grid=(1,))
    assert "after Up" not in caplog.text
    loads.mark_up()
    _copy_kernel.warmup(x, y, 63, BLOCK=64, grid=(1,))  # another specialisation, first met after Up
    assert loads.read()["kernel_loads_after_up"] == 1
    assert "loaded after Up" in caplog.text and "_copy_kernel" in caplog.text


def test_the_recorder_marks_the_entry_the_jit_compiled(jit, tmp_path):
    """The JIT's hook gives the recorder the kernel's cache entry: marked compiled at save(), the next start
    replays nothing of it (engine/compiled_specs.py); the entry is the directory Triton wrote."""
    store = CompiledSpecs(tmp_path / "compiled.jsonl", tmp_path / "triton")
    recorder = SpecRecorder(tmp_path / "specs.jsonl", compiled=store)
    x, y = torch.zeros(64), torch.zeros(64)
    _copy_kernel.warmup(x, y, 64, BLOCK=64, grid=(1,))
    ((spec, entry),) = recorder.specs.items()
    assert entry is not None and any((tmp_path / "triton" / d).is_dir() for d in entry_dirs(entry))
    assert store.pending([spec]) == [spec]
    recorder.save()
    assert store.pending([spec]) == []


_SCALE = tl.constexpr(2.0)


@triton.jit
def _scaled(x):
    return x * _SCALE


@triton.jit
def _scale_copy_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, _scaled(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def _forget_keys() -> None:
    """As in a fresh process: no key computed yet for the kernel or its helper."""
    for fn in (_scale_copy_kernel, _scaled):
        fn.hash, fn.used_global_vals = None, {}
    _scale_copy_kernel.device_caches.clear()


def _keyed_with_callee_globals() -> bool:
    return any(name == "_SCALE" for name, _ in _scale_copy_kernel.used_global_vals)


def test_the_jit_and_the_preload_key_a_kernel_with_its_callees_globals(jit, tmp_path, monkeypatch):
    """kernels/jit_keys.py: Triton 3.6 alone keys a kernel without its helper's constexpr globals when the
    kernel's key is computed first (`PYTHONPATH=/work/t36:.` shows it); the compile hook and the preload
    compute the helper's first, so the JIT, the preload and the precompile name the same cache entry."""
    from dsaserve.kernels import jit_keys

    monkeypatch.setattr(jit_keys, "_installed", False)
    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    assert jit_keys.install_compile_hook()
    _forget_keys()
    recorder = SpecRecorder(tmp_path / "specs.jsonl")
    x, y = torch.zeros(64), torch.zeros(64)
    _scale_copy_kernel.warmup(x, y, 64, BLOCK=64, grid=(1,))  # the JIT's compile, through the hook
    assert _keyed_with_callee_globals()
    ((spec, entry),) = recorder.specs.items()
    key = _scale_copy_kernel.hash

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)  # the preload alone primes it too
    _forget_keys()
    assert ws.preload_spec(spec) is None
    assert _keyed_with_callee_globals() and _scale_copy_kernel.hash == key
