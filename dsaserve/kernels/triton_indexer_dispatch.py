"""The GPU `indexer_topk` the registry binds: picks the indexer kernel by batch shape and static row length
(request path stage 6, full indexer layers).

Owns: the routing, nothing else.
  prefill-size batches (> triton_indexer.SELECT_MAX_ROWS tokens) with FP8 keys, outside CUDA-graph capture
      (a decode graph bucket may hold that many tokens; the prefill kernels' block tables are built on the host)
      -> `triton_indexer_gemm` (tiled FP8 score GEMM into a bounded chunk workspace + a top-k select of it: one
      program a row up to ROW_IN_REGS_MAX keys, the split radix past that; on the H200 1.46-1.77x the
      streaming kernel, each sampled selection the exact top-k of its own scores and near-ties where it parts
      from float64; its device tests pass), or with DSASERVE_INDEXER_PREFILL=stream `triton_indexer_prefill`
      (one FP8 GEMM with a streaming top-k);
  decode batches whose static row bound (page_table.shape[1] * page_size, fixed per CUDA-graph bucket) passes
      triton_indexer.ROW_IN_REGS_MAX keys -> `triton_indexer.index_scores` + `triton_indexer_long` (the rows
      split over programs), 1-2 rows `triton_indexer_coop` (the select in one cooperative launch; over the FP8
      cache up to 64K keys a row, the scores in that launch too);
  everything else -> `triton_indexer.indexer_topk` (scores + one program per row; torch.topk for prefill with
      bf16 / fp32 debugging keys; no scores at all when max_seq <= topk).
The thresholds are read from `triton_indexer` at call time. No host sync on the decode paths.
"""

from __future__ import annotations

import torch

from dsaserve.common import envs
from dsaserve.common.kv_layout import KVLayout, get_kv_layout
from dsaserve.kernels import (
    triton_indexer,
    triton_indexer_coop,
    triton_indexer_gemm,
    triton_indexer_long,
    triton_indexer_prefill,
)
from dsaserve.kernels.variants import fused_select_chunk, long_select_chunk


def _long_rows(q: torch.Tensor, head_weights: torch.Tensor, index_cache: torch.Tensor, layout: KVLayout,
               page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor, topk: int,
               page_size: int) -> torch.Tensor:
    """Decode rows past one program's reach: scores (rows below topk skipped: they take every key), then the
    split radix select, in row slices of at most SCORE_BUDGET bytes of scores. 1-2 rows over the FP8 cache take
    both in one cooperative launch (`triton_indexer_coop.coop_score_select`) up to `variants.FUSED_MAX_CHUNK`-key
    chunks (one row up to 64K keys, two up to 32K); past that, and over the plain layouts, their own select chunk
    (`variants.long_select_chunk`) and one cooperative select launch."""
    t, max_seq = q.shape[0], page_table.shape[1] * page_size
    out = torch.empty((t, topk), dtype=torch.int64, device=q.device)
    fused_chunk = fused_select_chunk(t, max_seq)
    if layout.plain_dtype is None and triton_indexer_coop.fused(t, max_seq, fused_chunk, q):
        triton_indexer_coop.coop_score_select(q, head_weights, index_cache, page_table, req_index, positions, out, topk,
                                              page_size, fused_chunk)
        return out
    step = max(1, triton_indexer.SCORE_BUDGET // (4 * max_seq))
    # chunk, late slots and launch kind chosen by the batch, not its slice: a batch's slices compile one variant each
    chunk = long_select_chunk(t, max_seq)
    coop = triton_indexer_coop.cooperative(t, max_seq, chunk, q)
    for s0 in range(0, t, step):
        sl = slice(s0, min(t, s0 + step))
        scores = triton_indexer.index_scores(q[sl], head_weights[sl], index_cache, layout, page_table, req_index[sl],
                                             positions[sl], page_size, skip_below=topk, fill=False)
        if coop:
            triton_indexer_coop.coop_select(scores, page_table, req_index[sl], positions[sl], out[sl], topk, page_size,
                                            chunk)
        else:
            triton_indexer_long.long_row_select(scores, page_table, req_index[sl], positions[sl], out[sl], topk,
                                                page_size, chunk=chunk,
                                                late_slots=t >= triton_indexer_long.LATE_SLOTS_ROWS)
    return out


def indexer_topk(q: torch.Tensor | None, head_weights: torch.Tensor | None, index_cache: torch.Tensor,
                 layout: KVLayout | str, page_table: torch.Tensor, req_index: torch.Tensor, positions: torch.Tensor,
                 topk: int, page_size: int, seq_lens: list[int] | None = None,
                 extend_lens: list[int] | None = None) -> torch.Tensor:
    """GPU `reference.indexer_topk` -> [T, topk] int64 physical slots, -1 padded (q and head_weights None: a batch
    within the top-k, every key)."""
    layout = get_kv_layout(layout, "indexer_topk: layout")
    t, max_seq = req_index.shape[0], page_table.shape[1] * page_size
    if max_seq > topk:
        if q is None:
            raise ValueError(f"indexer_topk: no queries, but rows reach {max_seq} keys, past top-{topk}")
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()  # prefill builds a host block table
        prefill = t > triton_indexer.SELECT_MAX_ROWS and not capturing
        if (prefill and envs.DSASERVE_INDEXER_PREFILL == "gemm"
                and triton_indexer_gemm.supported(layout, q.shape[2])):
            return triton_indexer_gemm.gemm_topk(q, head_weights, index_cache, layout, page_table, req_index,
                                                 positions, topk, page_size, seq_lens, extend_lens)
        if prefill and triton_indexer_prefill.supported(layout, q.shape[2]):
            return triton_indexer_prefill.prefill_topk(q, head_weights, index_cache, layout, page_table, req_index,
                                                       positions, topk, page_size, seq_lens, extend_lens)
        if t <= triton_indexer.SELECT_MAX_ROWS and max_seq > triton_indexer.ROW_IN_REGS_MAX:
            return _long_rows(q, head_weights, index_cache, layout, page_table, req_index, positions, topk, page_size)
    return triton_indexer.indexer_topk(q, head_weights, index_cache, layout, page_table, req_index, positions, topk,
                                       page_size, seq_lens, extend_lens)
