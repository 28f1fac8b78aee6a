"""The greedy argmax kernel (`kernels/triton_argmax.py`) as the GPU compiles it, offline for sm_90 on the CPU
(tests/offline_triton.py): one variant a logits dtype whatever the batch (a batch size never compiles after
start-up's warmup: `kernel_loads_after_up`), whole blocks read with 16-byte vector loads (the reason the chunk is
passed in blocks and the tail is apart), and the row's arrival a device-scope acquire-release atomic (the last
program reads the others' partials). The interpreter checks none of these."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")


from dsaserve.kernels import triton_argmax as A  # noqa: E402
from tests.offline_triton import offline_jit  # noqa: E402


def test_one_variant_a_dtype_with_vector_loads_and_an_ordered_arrival(monkeypatch, tmp_path):
    offline_jit(monkeypatch, tmp_path / "triton", (A._row_argmax_kernel,), launches=True)
    monkeypatch.setattr(A, "_sm_count", lambda device: 132)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 7, 64, 128, 3000):  # every split plan, from 19 programs a row to 1
            A.row_argmax(torch.zeros(rows, 154_880, dtype=dtype))
        A.row_argmax(torch.zeros(3, 200_000, dtype=dtype)[:2, :129_281])  # a view: another width, a tail block
    ptx = [p.read_text() for p in (tmp_path / "triton").rglob("*.ptx")]
    assert len(ptx) == 2, f"{len(ptx)} variants for two dtypes: the batch's numbers are specialised"
    for text in ptx:
        assert re.search(r"ld\.global(\.\w+)*\.v4\.b32", text), "whole blocks are not read with 16-B loads"
        assert re.search(r"atom\.global\.gpu\.acq_rel\.add", text), "the arrival is not an acq_rel atomic"
