"""BatchBuilder: freezes a step's scheduling decisions into a ForwardBatch (request path stage 4).

Owns: the host-side page table (one row per running request, `max_pages_per_seq` wide, SGLang's
req_to_token pool at page granularity) and the flat per-token tensors of model/forward_batch.py:
input_ids, positions, req_index, out_cache_loc, seq_lens, extend_lens, page_table, logits_indices.
Only the last token of a request that finishes its pending tokens produces logits: a prefill chunk
that is not the prompt's last computes KV only (note 001: "prefill 不做采样"). A decode row with drafts
(speculative decoding, engine/mtp.py) computes the last token and its drafts, and each produces logits.

Cost model (note 001, "每步的 Python 预算"): rows are written only when a request gains pages (once per
64 decode steps), decode rows are a handful of list appends each, prefill chunks are sliced in numpy,
and the page table is one fancy-index copy. Tensors are built on the host; the engine moves them to the
device (a CUDA-graph runner would copy them into its static buffers instead).
"""

from __future__ import annotations

import numpy as np
import torch

from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.model.forward_batch import ForwardBatch


class BatchBuilder:
    def __init__(self, max_rows: int, max_pages_per_seq: int, page_size: int):
        self.page_size = page_size
        self.table = np.zeros((max_rows, max_pages_per_seq), dtype=np.int64)

    def build(self, sched: ScheduledBatch) -> ForwardBatch:
        ps, table = self.page_size, self.table
        ids: list[int] = []
        pos: list[int] = []
        req_index: list[int] = []
        out: list[int] = []
        seq_lens: list[int] = []
        logit_idx: list[int] = []
        rows: list[int] = []
        gens: list[int] = []
        t = 0
        for r, (req, n) in enumerate(zip(sched.reqs, sched.num_new, strict=True)):
            pages, row = req.pages, req.row
            if req.pages_synced != len(pages):
                table[row, req.pages_synced:len(pages)] = pages[req.pages_synced:]
                req.pages_synced = len(pages)
            nc = req.num_computed
            end = nc + n
            if n == 1:
                ids.append(req.tokens[nc])
                pos.append(nc)
                req_index.append(r)
                out.append(pages[nc // ps] * ps + nc % ps)
            else:
                p = np.arange(nc, end)
                ids += req.tokens[nc:end] if end <= len(req.tokens) else [*req.tokens[nc:], *req.drafts]
                pos += range(nc, end)
                req_index += [r] * n
                out += (table[row, p // ps] * ps + p % ps).tolist()
            t += n
            if end == len(req.tokens):
                logit_idx.append(t - 1)
            elif end > len(req.tokens):  # its drafts ride along (engine/mtp.py): the last token's and each draft's
                logit_idx += range(t - 1 - (end - len(req.tokens)), t)
            seq_lens.append(end)
            rows.append(row)
            gens.append(req.row_gen)
        ext = list(sched.num_new)
        width = -(-max(seq_lens) // ps)
        page_table = torch.from_numpy(table[rows, :width])
        return ForwardBatch(
            input_ids=_i64(ids), positions=_i64(pos), req_index=_i64(req_index), seq_lens=_i64(seq_lens),
            extend_lens=_i64(ext), page_table=page_table, out_cache_loc=_i64(out), logits_indices=_i64(logit_idx),
            page_size=ps, seq_lens_cpu=seq_lens, extend_lens_cpu=ext,
            table_rows=np.array(rows, dtype=np.int64), table_gens=np.array(gens, dtype=np.int64))


def _i64(values: list[int]) -> torch.Tensor:
    """list -> int64 tensor through numpy: ~4x faster than torch.tensor(list) for a few hundred ints."""
    return torch.from_numpy(np.array(values, dtype=np.int64))
