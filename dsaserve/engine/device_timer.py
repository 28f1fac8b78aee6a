"""Device-busy time of the engine's steps, measured on the GPU without a host sync.

Owns: `DeviceTimer`, a pair of CUDA timing events around each step's device work (forward and sampling, as
they sit on the compute stream), folded into the `device_busy_seconds` counter once the step's end event has
completed. Under overlap scheduling a step's start event runs when the device reaches it, after the step
before, so the sum is the device's time on steps, not the host's. `device_busy_seconds` over a run's wall
time is the fraction of the run the engine kept the device busy: what `bench/serve_layouts.py` sets beside
the server's throughput (issue 16: output tokens/s >= 0.9 of what the engine's step times allow). On the CPU
the timer does nothing.
"""

from __future__ import annotations

from collections import deque

import torch

from dsaserve.common.counters import COUNTERS


class DeviceTimer:
    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._free: list[torch.cuda.Event] = []  # events whose times were read: recorded again, not re-made
        self._busy_s = 0.0
        if self.enabled:
            COUNTERS.add_source(self.read)

    def _event(self) -> torch.cuda.Event:
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> torch.cuda.Event | None:
        return self._event() if self.enabled else None

    def stop(self, start: torch.cuda.Event | None) -> None:
        if start is None:
            return
        self._pending.append((start, self._event()))
        self._collect()

    def _collect(self) -> None:
        while self._pending and self._pending[0][1].query():  # query() never waits
            a, b = self._pending.popleft()
            self._busy_s += a.elapsed_time(b) / 1e3
            self._free += (a, b)

    def read(self, reset: bool) -> dict[str, float]:
        self._collect()
        out = {"device_busy_seconds": self._busy_s} if self._busy_s else {}
        if reset:
            self._busy_s = 0.0
        return out
