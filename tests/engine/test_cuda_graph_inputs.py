"""The decode graphs' input staging (engine/cuda_graph_runner.py), checked on the CPU: a host batch is
written into the pinned twin's layout, padded up to its bucket, and lands in the static input views the
graphs read. (Capture and replay themselves need CUDA: tests/engine/test_engine_gpu.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsaserve.engine.cuda_graph_runner import CudaGraphRunner
from dsaserve.model.forward_batch import contiguous_batch

PAGE, SINK = 64, 99


def _runner(max_bs: int = 8, max_pages: int = 6) -> CudaGraphRunner:
    pool = SimpleNamespace(page_size=PAGE, kv_buffer=torch.empty(1))  # only its device and page size are read
    return CudaGraphRunner(model=None, pool=pool, max_bs=max_bs, max_pages_per_req=max_pages, sink_page=SINK)


def test_a_host_batch_lands_in_the_static_inputs_with_its_bucket_padded():
    g = _runner()
    assert g.copy_in_graph is False and g.buckets == [1, 2, 4, 8]
    batch = contiguous_batch([[11], [12], [13]], [5, 70, 130], [0, 2 * PAGE, 5 * PAGE], PAGE)
    g._load_host(batch, 3, 4)
    assert g.input_ids[:3].tolist() == [11, 12, 13]
    assert g.positions[:3].tolist() == [5, 70, 130]
    assert g.seq_lens[:3].tolist() == [6, 71, 131]
    assert g.req_index[:3].tolist() == [0, 1, 2]
    assert g.out_cache_loc[:3].tolist() == [5, 2 * PAGE + 70, 5 * PAGE + 130]
    assert g.page_table[:3, :3].tolist() == [[0, 0, 0], [2, 3, 0], [5, 6, 7]]  # width 3 = the longest row
    # row 3 pads the bucket: a 1-token dummy request of its own whose KV goes to the sink page
    assert (g.input_ids[3], g.positions[3], g.seq_lens[3], g.req_index[3]) == (0, 0, 1, 3)
    assert g.out_cache_loc[3] == SINK * PAGE and (g.page_table[3] == SINK).all()
    assert (g.page_table[:3, 3:] == SINK).all()  # columns past the batch's width never name a real page


def test_a_smaller_batch_after_a_larger_one_rewrites_only_its_rows_and_padding():
    g = _runner()
    g._load_host(contiguous_batch([[1]] * 4, [10] * 4, [r * PAGE for r in range(4)], PAGE), 4, 4)
    g._load_host(contiguous_batch([[7]], [3], [PAGE], PAGE), 1, 1)
    assert g.input_ids[0] == 7 and g.out_cache_loc[0] == PAGE + 3 and g.page_table[0, 0] == 1
    assert g.input_ids[1:4].tolist() == [1, 1, 1]  # outside bucket 1: never read by its graph
