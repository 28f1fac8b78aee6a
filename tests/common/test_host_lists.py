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


def test_a_host_batch_goes_to_a_gpu_through_to_device_and_keeps_its_host_page_table(monkeypatch):
    """`ForwardBatch.to(cuda)` sends every host tensor through `to_device` (pinned memory: a pageable copy waits for
    the device's queued work); the host page table stays as `page_table_cpu`. Recorded with `to_device` stubbed,
    so it runs without a GPU."""
    from dsaserve.model import forward_batch
    from dsaserve.model.forward_batch import contiguous_batch

    sent = []
    monkeypatch.setattr(forward_batch, "to_device", lambda t, dtype, device: sent.append((t, dtype, device)) or t)
    batch = contiguous_batch([[1, 2, 3], [4, 5]], [0, 0], [0, 128], 64)
    moved = batch.to("cuda")
    tensors = [v for k, v in vars(batch).items() if isinstance(v, torch.Tensor) and k != "page_table_cpu"]
    assert [t for t, _, _ in sent] == tensors and len(tensors) >= 7
    assert all(dtype == t.dtype and device == torch.device("cuda") for t, dtype, device in sent)
    assert moved.page_table_cpu is batch.page_table
