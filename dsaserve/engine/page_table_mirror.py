"""A wide decode graph's page table, kept on the device by request row and changed in place each step.

Owns: the device copy of the requests' page table (SGLang's req_to_token pool, at page granularity) for a width
class whose table is too large to copy each step (engine/cuda_graph_runner.py), its pinned host twin, and the
changes a step stages. Rows are keyed by the batch builder's request rows (`ForwardBatch.table_rows`, stable while a
request runs; a batch without them keys by its own rows), so a request that leaves the middle of the batch moves
no other row's pages. Only what changed goes into the staged inputs as (flat index, page) pairs: with the builder's
row generations (`ForwardBatch.table_gens`, a new one each time a request takes the row) the pages each request
needs past those the device holds for it (a new page every ~64 decode steps; all of a new request's), found
without reading the table; without them every entry compared with the twin. The graph's first kernel writes the
pairs into the device copy (`stage_from_host`); the graph then gathers its rows by key into its static page table
(one device copy).
Why: a batch of 3+ rows past the top-k replays max_model_len's class, whose whole table the copy engine moved each
step from the host before the step's first kernel: 44 µs at 128 rows x 131,136 keys, 66 at GLM-5.3's 202,752
positions (H100, `bench/probe_table_copy.py`, bench/RESULTS.md forty-sixth session).

Invariant: the device copy equals the twin. A step whose changes do not fit the staged pairs (several long requests
joining at once) has the caller copy the whole twin instead. The last row is all sink pages: padding rows read it.
Columns past a row's width keep what an earlier request left there (valid pages; nothing reads past a row's
position), as the whole table's copy did.
"""

from __future__ import annotations

import numpy as np
import torch

_NONE = np.zeros(0, dtype=np.int64)


class PageTableMirror:
    def __init__(self, rows: int, max_pages: int, sink_page: int, staged: np.ndarray, device: torch.device):
        """rows: request rows the batches' keys may name (the batch builder's, or the graphs' max_bs, whichever is
        more); staged: the pinned region the graph reads the changes from ([count, flat indices, pages])."""
        self.sink_row = rows  # one past the keys: all sink pages, never written
        self.host = torch.full((rows + 1, max_pages), sink_page, dtype=torch.int64)
        if device.type == "cuda":
            self.host = self.host.pin_memory()
        self.device = self.host.to(device, copy=True)
        self.shadow = self.host.numpy()
        self.staged = staged
        self.max_deltas = (staged.size - 1) // 2
        # by row: the builder's generation of the request whose pages the device holds (-1: not known) and how many
        # of its leading pages it holds (a request's pages only grow while it holds its row: engine/batch.py)
        self.gen = np.full(rows, -1, dtype=np.int64)
        self.cols = np.zeros(rows, dtype=np.int64)

    def keys(self, table_rows, bs: int) -> np.ndarray | None:
        """The mirror rows a batch of `bs` rows reads: the builder's rows where given, distinct and in range, else
        None (the batch's own rows, compared whole)."""
        if table_rows is None:
            return None
        keys = np.asarray(table_rows, dtype=np.int64)
        if keys.size != bs or (bs and (keys.min() < 0 or keys.max() >= self.sink_row
                                       or np.count_nonzero(np.bincount(keys)) != bs)):
            return None
        return keys

    def stage(self, rows: np.ndarray, keys: np.ndarray | None, gens: np.ndarray | None, need: np.ndarray) -> bool:
        """The twin's rows `keys` (None: 0..bs-1) <- the batch's table `rows` [bs, width], and what changed staged for
        the graph. With the builder's generations `gens`, a row's changes are its pages past those the device holds
        for that request (all of them for a new request), up to the `need` [bs] pages its length covers; without,
        every entry is compared with the twin. False: they do not fit, none is staged, and the caller copies the
        whole twin (`copy_whole`)."""
        if keys is None or gens is None:
            r, c, pages = self._compare(rows, keys)
            keys = np.arange(rows.shape[0]) if keys is None else keys
            self.gen[keys] = -1  # what these rows hold is not a generation's pages
        else:
            r, c, pages = self._appended(rows, keys, gens, need)
        n = r.size
        if not n:  # most decode steps (host time: the synchronous step waits for it)
            self.staged[0] = 0
            return True
        self.shadow[keys[r], c] = pages
        if n > self.max_deltas:
            self.staged[0] = 0
            return False
        self.staged[0] = n
        self.staged[1:1 + n] = keys[r] * self.shadow.shape[1] + c
        self.staged[1 + self.max_deltas:1 + self.max_deltas + n] = pages
        return True

    def _compare(self, rows: np.ndarray, keys: np.ndarray | None):
        """(row, column, page) of every entry of `rows` that differs from the twin's rows `keys`."""
        width = rows.shape[1]
        held = self.shadow[:rows.shape[0], :width] if keys is None else self.shadow[keys, :width]
        changed = np.flatnonzero(held != rows)
        r, c = np.divmod(changed, width)
        return r, c, rows.reshape(-1)[changed]

    def _appended(self, rows: np.ndarray, keys: np.ndarray, gens: np.ndarray, need: np.ndarray):
        """(row, column, page) of the pages each row needs past those the device holds for its request."""
        held = self.gen[keys] == gens
        start = np.where(held, self.cols[keys], 0)
        stop = np.minimum(need, rows.shape[1])
        grow = np.flatnonzero(stop > start)  # most steps: none, or the few rows that crossed into a page
        if grow.size or not held.all():
            self.gen[keys] = gens
            self.cols[keys] = np.maximum(start, stop)
        if not grow.size:
            return _NONE, _NONE, _NONE
        count = stop[grow] - start[grow]
        r = np.repeat(grow, count)
        c = np.arange(r.size) - np.repeat(np.cumsum(count) - count, count) + np.repeat(start[grow], count)
        return r, c, rows[r, c]

    def copy_whole(self) -> None:
        """The whole twin to the device (queued on the current stream, before the replay that reads it)."""
        self.device.copy_(self.host, non_blocking=True)
