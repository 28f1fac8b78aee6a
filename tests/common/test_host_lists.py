"""`host_lists.to_device` (host lists and host tensors onto the device without a stream sync): the values and the
dtype asked, from a list or a tensor alike (on the CPU here; the pinned path is the GPU's)."""

from __future__ import annotations

import torch

from dsaserve.common.host_lists import to_device


def test_a_list_and_a_host_tensor_arrive_alike_in_the_dtype_asked():
    cpu = torch.device("cpu")
    from_list = to_device([3, 1, 2], torch.int64, cpu)
    from_tensor = to_device(torch.tensor([3, 1, 2], dtype=torch.int32), torch.int64, cpu)
    assert from_list.dtype == from_tensor.dtype == torch.int64
    assert torch.equal(from_list, from_tensor) and from_tensor.tolist() == [3, 1, 2]
