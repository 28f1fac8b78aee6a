"""Host lists onto the device, and device results back to the host, without waiting for the device (but for
`to_device`'s moves to the host, read at once).

Owns: `to_device` and `HostCopy`. `torch.tensor(values, device="cuda")` copies from pageable memory, which
synchronises the stream: the host waits for every queued kernel (under overlap scheduling the whole forward; in a
chunked prefill loop the GPU then idles while the host launches the next chunk). A non-blocking copy out of pinned
memory is queued behind the work in flight instead; PyTorch's caching host allocator keeps the pinned block until
that copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any] | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)` (or a host tensor `.to` it), queued behind the device's
    work (no sync; a move to the host waits for its copy)."""
    if isinstance(values, torch.Tensor):
        if values.device.type == "cpu" and device.type == "cuda":
            return values.to(dtype).pin_memory().to(device, non_blocking=True)
        # any other way: `.to` as it is, queued where it stays on a device; a host tensor is read at once, so a move
        # to the host waits for its copy (a non-blocking one out of the GPU may still be in flight)
        return values.to(device, dtype, non_blocking=device.type != "cpu")
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class HostCopy:
    """Device tensors on their way to the host: non-blocking copies (out of the GPU they land in pinned memory)
    queued at once behind an event; `lists()` waits for the event and gives them as Python lists. The sampler's
    tokens and logprobs and the prompt logprobs come back so, behind the step that made them."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self._host = [t.to("cpu", non_blocking=True) for t in tensors]
        self._event = torch.cuda.Event() if tensors and tensors[0].is_cuda else None
        if self._event is not None:
            self._event.record()

    def lists(self) -> list[list[Any]]:
        if self._event is not None:
            self._event.synchronize()
        return [t.tolist() for t in self._host]
