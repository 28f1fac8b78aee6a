"""Host lists onto the device without waiting for it.

Owns: `to_device`. `torch.tensor(values, device="cuda")` copies from pageable memory, which synchronises the
stream: the host waits for every queued kernel (under overlap scheduling the whole forward; in a chunked
prefill loop the GPU then idles while the host launches the next chunk). A non-blocking copy out of pinned
memory is queued behind the work in flight instead; PyTorch's caching host allocator keeps the pinned block
until that copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def to_device(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.tensor(values, dtype=dtype, device=device)`, queued behind the device's work (no sync)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
