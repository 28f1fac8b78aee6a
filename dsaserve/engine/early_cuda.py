"""The rank's CUDA context, created on a thread at process start while torch imports (issue 16: "<= 5 s warm").

Owns: `start(engine_args)`, which a scheduler process calls first thing (before `import torch`): a daemon
thread calls the CUDA driver through ctypes (`cuInit`, then `cuDevicePrimaryCtxRetain` for the GPU this rank
will use), and `report()`, what it did, for the manifest.

Why: the device's primary context (the context torch's runtime uses too) costs a few hundred milliseconds to
create on an H200, and it was created inside "load weights", by the first tensor allocated there, after the
~2.5 s of torch's import. ctypes lets go of the GIL during each driver call, so the import runs on meanwhile;
torch later finds the context made (the runtime retains the same primary context) and goes on. The retained
reference is never released: the context lives as long as the process, as it would anyway. Correctness does
not depend on it: when the thread is still creating the context, torch's first call waits for the driver;
when it fails (no libcuda: a CPU machine), torch creates the context itself as before. The GPU is the one
`parallel_state.local_device` will give the rank, by the same rule (distributed/rank_gpu.py); where that rule
needs torch's GPU count, no early context is made. `start` also says whether the rank is a CUDA rank (the
scheduler process precompiles kernels only for one). `DSASERVE_EARLY_CUDA=0` is the A/B switch. Module scope:
standard library only (it runs before `import torch`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import time
from typing import Any

from dsaserve.common import envs
from dsaserve.distributed.rank_gpu import gpu_ordinal

_report: dict[str, Any] = {"status": "not started"}


def _device(engine_args: dict[str, Any]) -> str:
    """The device string the engine will resolve to, short of torch."""
    device = engine_args.get("device")
    if device is None:
        from dsaserve.engine.engine_args import no_gpu_present

        device = "cpu" if no_gpu_present() else "cuda"  # what resolved_device decides, short of torch
    return str(device)


def _ordinal_of(device: str) -> int | None:
    """`gpu_ordinal` for a CUDA device string, with the world from $WORLD_SIZE / $RANK (None: a malformed
    index, or not known before torch)."""
    index = None
    if ":" in device:
        try:
            index = int(device.split(":", 1)[1])
        except ValueError:
            return None
    return gpu_ordinal(index, int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0")))


def device_ordinal(engine_args: dict[str, Any]) -> int | None:
    """The GPU ordinal this rank's forward will run on, or None: not a CUDA rank (or not known before torch)."""
    device = _device(engine_args)
    return _ordinal_of(device) if device.startswith("cuda") else None


@dataclasses.dataclass(frozen=True)
class Started:
    """What `start` found: a CUDA rank or not, its GPU (None: not a CUDA rank, or not known before torch),
    and the thread making the context (None: none started)."""

    cuda: bool
    device: int | None = None
    thread: threading.Thread | None = None


def _create(ordinal: int) -> None:
    t0 = time.perf_counter()
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        for call, args in (("cuInit", (0,)), ("cuDeviceGet", (ctypes.byref(dev), ordinal)),
                           ("cuDevicePrimaryCtxRetain", (ctypes.byref(ctx), dev))):
            rc = getattr(lib, call)(*args)
            if rc != 0:
                raise RuntimeError(f"{call} returned CUDA error {rc}")
        _report.update(status="created", device=ordinal)
    except (OSError, AttributeError, RuntimeError) as e:  # torch creates the context itself, as before
        _report.update(status="failed", error=f"{type(e).__name__}: {e}"[:300])
    _report["seconds"] = round(time.perf_counter() - t0, 4)


def start(engine_args: dict[str, Any]) -> Started:
    """The context of this rank's GPU created on a daemon thread (none: switched off, not a CUDA rank, or its GPU
    not known before torch); what it found, so the caller need not work the rank's device out again."""
    _report.clear()
    device = _device(engine_args)
    cuda = device.startswith("cuda")
    ordinal = _ordinal_of(device) if cuda else None
    if not envs.DSASERVE_EARLY_CUDA:
        _report.update(status="off")
        return Started(cuda, ordinal)
    if not cuda:
        _report.update(status="not a CUDA rank")
        return Started(False)
    if ordinal is None:  # several ranks, no LOCAL_RANK: rank mod the GPU count, which torch counts later
        _report.update(status="device not known before torch")
        return Started(True)
    _report.update(status="running", device=ordinal)
    # the driver reads this at cuInit; torch sets the same default in its own CUDA init, which now comes later
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    thread = threading.Thread(target=_create, args=(ordinal,), name="early-cuda-context", daemon=True)
    thread.start()
    return Started(True, ordinal, thread)


def report() -> dict[str, Any]:
    """What `start` did: status (created / failed / off / running / not a CUDA rank / device not known before
    torch / not started), device, seconds."""
    return dict(_report)
