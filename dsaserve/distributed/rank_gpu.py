"""Which GPU of its host a rank uses: the one rule, applied before torch's import and after it.

Owns: `gpu_ordinal`. Its two callers: `engine/early_cuda.py` (the rank's CUDA context, made on a thread while
torch imports: the GPU must be known without torch) and `parallel_state.local_device` (the rank's device once
torch is there, and the one `init_distributed` binds NCCL to). One rule, so the early context is made on the
GPU the rank computes on, or on none; before this they restated it with different fallbacks (rank 3 of a
world without $LOCAL_RANK made its early context on GPU 0 and computed on GPU 3 % n). Standard library only:
it runs before `import torch`.
"""

from __future__ import annotations

import os
from collections.abc import Callable


def gpu_ordinal(index: int | None, world_size: int, rank: int,
                gpu_count: Callable[[], int] | None = None) -> int | None:
    """The GPU (an ordinal within CUDA_VISIBLE_DEVICES, as torch's) a rank uses: `cuda:N` -> N (`index`); one
    rank -> 0 (a bare `cuda` is torch's current device, 0 in a fresh process); several ranks -> $LOCAL_RANK,
    else the rank modulo the host's GPU count. `gpu_count` is torch's count; before torch's import it is not
    known (None), and the answer is then None unless the rank is 0 (0 modulo any count)."""
    if index is not None:
        return index
    if world_size <= 1:
        return 0
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if gpu_count is None:
        return 0 if rank == 0 else None
    return rank % max(gpu_count(), 1)
