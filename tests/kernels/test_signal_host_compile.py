"""The staging signal's kernel (`triton_elementwise._signal_host_kernel`, cuda_graph_runner.STAGED_MARK "token") as the
GPU compiles it, offline for sm_90 on the CPU (tests/offline_triton.py): one program that loads the pinned token and
stores it into the pinned `done` word, a 64-bit word each way, and nothing else reaches memory (the host polls that
word; a second store or a narrower one would show it a torn or early token). The interpreter checks none of this."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")

from dsaserve.kernels import triton_elementwise as E  # noqa: E402
from tests.offline_triton import offline_jit  # noqa: E402


def test_one_64_bit_load_and_one_64_bit_store(monkeypatch, tmp_path):
    offline_jit(monkeypatch, tmp_path / "triton", (E._signal_host_kernel,))
    words = torch.zeros(2, dtype=torch.int64)
    E._signal_host_kernel.warmup(E._HostPointer(words[:1]), E._HostPointer(words[1:]), grid=(1,))
    (ptx,) = [p.read_text() for p in (tmp_path / "triton").rglob("*.ptx")]
    loads = re.findall(r"ld\.global[\w.]*", ptx)
    stores = re.findall(r"st\.global[\w.]*", ptx)
    assert len(loads) == 1 and loads[0].endswith(("b64", "u64", "s64")), loads
    assert len(stores) == 1 and stores[0].endswith(("b64", "u64", "s64")), stores
