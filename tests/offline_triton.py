"""Triton's JIT without a GPU, for the tests that compile kernels offline: a driver stand-in gives the JIT an sm_90
target, so a launch with `warmup=True` compiles (Triton ships ptxas) and runs nothing; the module load, the one
step that needs a device, is stubbed. What these tests read is what the JIT compiled and how it keyed it."""

from __future__ import annotations

import os

import pytest
import torch
from triton.backends.compiler import GPUTarget


class Sm90Driver:
    """What the JIT asks of its driver before any launch: device, stream, target."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def offline_jit(monkeypatch, cache_dir, kernels=(), launches: bool = False) -> list[str]:
    """Compile offline into `cache_dir` for the rest of the test: the names of the kernels whose module would have
    been loaded, in order. `kernels`: JIT functions given empty in-memory caches for the test (their own back after
    it: a kernel compiled here has no module, and a later launch on a GPU must not find it). `launches`: every
    `kernel[grid](...)` compiles (`JITFunction.warmup`) and runs nothing, so a launcher's own code can be called."""
    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter's kernels have no JIT to compile offline
        pytest.skip("offline sm_90 compiles need Triton's JIT, not its interpreter (TRITON_INTERPRET=1)")
    import triton
    from triton.compiler import CompiledKernel
    from triton.runtime import driver

    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache_dir))
    handles: list[str] = []
    monkeypatch.setattr(CompiledKernel, "_init_handles", lambda self: handles.append(self.name))
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", triton.knobs.runtime.jit_post_compile_hook)
    monkeypatch.setattr(driver, "_active", Sm90Driver())
    for fn in kernels:
        monkeypatch.setattr(fn, "device_caches", type(fn.device_caches)(fn.device_caches.default_factory))
    if launches:
        from triton.runtime.jit import JITFunction

        monkeypatch.setattr(JITFunction, "__getitem__",
                            lambda fn, grid: lambda *a, **kw: fn.warmup(*a, grid=grid, **kw))
    return handles
