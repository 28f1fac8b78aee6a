"""engine/device_timer.py: the device time of steps, summed from CUDA events without a host sync (GPU part
skipped without CUDA); on the CPU it does nothing and reports nothing."""

from __future__ import annotations

import pytest
import torch

from dsaserve.engine.device_timer import DeviceTimer


def test_on_the_cpu_the_timer_is_off():
    timer = DeviceTimer(torch.device("cpu"))
    timer.stop(timer.start())
    assert timer.read(False) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_it_sums_each_steps_device_time_and_reuses_its_events():
    timer = DeviceTimer(torch.device("cuda"))
    wall = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wall[0].record()
    for _ in range(3):
        t = timer.start()
        torch.cuda._sleep(20_000_000)  # ~10 ms of device time per step
        timer.stop(t)
    wall[1].record()
    torch.cuda.synchronize()
    busy = timer.read(False)["device_busy_seconds"]
    assert 0.9 * wall[0].elapsed_time(wall[1]) / 1e3 < busy <= 1.001 * wall[0].elapsed_time(wall[1]) / 1e3
    made = len(timer._free)
    timer.stop(timer.start())
    assert len(timer._free) <= made  # read events were recorded again, not made anew
    torch.cuda.synchronize()
    assert timer.read(True)["device_busy_seconds"] >= busy and timer.read(False) == {}
