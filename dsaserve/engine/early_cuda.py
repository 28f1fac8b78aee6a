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
`local_device` gives the rank: `cuda:N` as given, else LOCAL_RANK under several ranks, else device 0 (device
ordinals within CUDA_VISIBLE_DEVICES, as torch's). `DSASERVE_EARLY_CUDA=0` is the A/B switch. Module scope:
standard library only.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

from dsaserve.common import envs

_report: dict[str, Any] = {"status": "not started"}


def device_ordinal(engine_args: dict[str, Any]) -> int | None:
    """The GPU ordinal this rank's forward will run on, or None: not a CUDA rank (or not known before torch)."""
    device = engine_args.get("device")
    if device is None:
        from dsaserve.engine.engine_args import no_gpu_present

        device = "cpu" if no_gpu_present() else "cuda"  # what resolved_device decides, short of torch
    device = str(device)
    if not device.startswith("cuda"):
        return None
    if ":" in device:
        try:
            return int(device.split(":", 1)[1])
        except ValueError:
            return None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("LOCAL_RANK", "0"))
    return 0


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


def start(engine_args: dict[str, Any]) -> threading.Thread | None:
    """The context of this rank's GPU created on a daemon thread (None: switched off, or not a CUDA rank)."""
    _report.clear()
    if not envs.DSASERVE_EARLY_CUDA:
        _report.update(status="off")
        return None
    ordinal = device_ordinal(engine_args)
    if ordinal is None:
        _report.update(status="not a CUDA rank")
        return None
    _report.update(status="running", device=ordinal)
    # the driver reads this at cuInit; torch sets the same default in its own CUDA init, which now comes later
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    thread = threading.Thread(target=_create, args=(ordinal,), name="early-cuda-context", daemon=True)
    thread.start()
    return thread


def report() -> dict[str, Any]:
    """What `start` did: status (created / failed / off / running / not started), device, seconds."""
    return dict(_report)
