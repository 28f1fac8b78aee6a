"""CUDA-graph decode runner (startup chain: "warmup" then "capture CUDA graphs"; every decode step after).

Owns: one graph per decode batch bucket up to `cuda_graph_max_bs`, the static input buffers the graphs
read (input_ids, positions, req_index, seq_lens, page_table, out_cache_loc) and their pinned host twin,
padding a batch up to its bucket, and the counters a replay cannot bump from Python (`graph_replays`, the
collectives; the step's byte terms come from `model/step_counts.py`, as for an eager step). A step's host
batch is written into the twin with numpy and reaches the device in one copy captured inside the graph,
so a replayed step makes one CUDA call: on the H200's host every call is tens of µs the GPU idles through
before a synchronous step starts (bench/RESULTS.md). Up to 64 KB that copy is a kernel reading the pinned twin
(`triton_elementwise.copy_from_host`), not a copy node: the step's kernels start a few µs sooner. A class whose
page table is larger keeps the requests' pages on the device and stages only their changes
(engine/page_table_mirror.py).

Why the whole decode step fits in one graph (the piecewise graphs of engine/piecewise_runner.py are for
steps with a prefill part): the indexer's top-k runs on a static
[bs, max_context] score buffer masked by each token's position, and slot translation reads the static
page table on the device — no host sync, no data-dependent shapes. Padded rows write their KV into a
reserved sink page that no request owns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from dsaserve.common import envs
from dsaserve.common.counters import COUNTERS, Counters
from dsaserve.common.host_lists import to_device
from dsaserve.engine.graph_capture import capture_bucket, lean_capture
from dsaserve.engine.page_table_mirror import PageTableMirror
from dsaserve.engine.warmup_plan import decode_buckets
from dsaserve.kernels.registry import get_ops
from dsaserve.model.forward_batch import ForwardBatch
from dsaserve.model.step_counts import count_step


def _copy_node(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


# (device, op) -> whether its probe passed: each width class's runner and MTP's ask the same question at start-up
_PROBED: dict[tuple[torch.device, object], bool] = {}


def _graph_h2d_copy_works(device: torch.device, copy=_copy_node) -> bool:
    """Whether `copy` (dst, src) out of pinned host memory captures into a CUDA graph and, replayed, reads the
    host memory as it is then (probed once a device and copy). DSASERVE_GRAPH_H2D=0 keeps the copy outside the
    graphs."""
    return bool(envs.DSASERVE_GRAPH_H2D) and _probed(device, copy, _probe_graph_copy)


def _stage_op_works(device: torch.device, stage) -> bool:
    """Whether `stage` (the registry's `stage_from_host`) captured into a CUDA graph reads, at each replay, the
    rows, the count and that many changes as the pinned buffer holds them then (the reference, which reads the
    count when it runs, does not). Probed once a device and op."""
    return _probed(device, stage, _probe_stage)


def _probed(device: torch.device, op, probe) -> bool:
    key = (torch.device(device), op)
    if key not in _PROBED:
        _PROBED[key] = probe(device, op)
    return _PROBED[key]


def _replay_reads_host(device: torch.device, run, change, check) -> bool:
    """Capture run(), then change() the pinned inputs, replay, and check() what the replay made; False on any
    capture error."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        change()  # written after the capture: the replay must read these values
        graph.replay()
        torch.cuda.synchronize(device)
        return check()
    except Exception:  # noqa: BLE001 - any capture error means: the copy outside the graph / the whole table
        torch.cuda.synchronize(device)
        return False


def _probe_stage(device: torch.device, stage) -> bool:
    src = torch.tensor([1, 2, 3, 4], dtype=torch.int64).pin_memory()
    changes = torch.tensor([1, 2, 0, 0, 0, 77, 0, 0, 0], dtype=torch.int64).pin_memory()  # 4 pairs, 1 counted
    rows = torch.zeros(4, dtype=torch.int64, device=device)
    table = torch.zeros(9, dtype=torch.int64, device=device)
    want = torch.zeros(9, dtype=torch.int64)
    want[0], want[8] = 5, 6  # the 2 changes written after the capture

    def change() -> None:
        src.mul_(3)
        changes.copy_(torch.tensor([2, 0, 8, 0, 0, 5, 6, 0, 0]))

    return _replay_reads_host(device, lambda: stage(rows, src, table, changes, 4), change,
                              lambda: torch.equal(rows.cpu(), src) and torch.equal(table.cpu(), want))


def _probe_graph_copy(device: torch.device, copy) -> bool:
    src = torch.arange(1, 9, dtype=torch.int64).pin_memory()
    dst = torch.zeros(8, dtype=torch.int64, device=device)
    return _replay_reads_host(device, lambda: copy(dst, src), lambda: src.mul_(3),
                              lambda: torch.equal(dst.cpu(), src))


INPUT_ROWS = 5  # input_ids, positions, req_index, seq_lens, out_cache_loc
# A bucket whose page table is past this many bytes keeps the requests' pages on the device and stages only their
# changes (engine/page_table_mirror.py), where the graph's kernel can read them (`stage_from_host` passes its probe);
# smaller ones copy theirs whole. The copy engine took 13 µs for 128 rows x 32K keys' pages, 42-44 for 131,136
# keys' and 64-66 for 202,752's, the changes and the rows' gather 5.4-8.5 µs, and below ~256 KB of table the copy
# is as fast (7.8 µs at 64 rows x 32K keys, 5.4-6.5 staged); at 4 rows x 131,136 keys (64 KB) the step timed the
# same overlapped and 33 µs slower synchronous with the changes staged (H100, bench/probe_table_copy.py --deltas,
# profile_decode --ab default,full_table; bench/RESULTS.md forty-seventh session). False: every bucket copies its
# whole table.
TABLE_MIRROR = True
TABLE_MIRROR_MIN_BYTES = 256 << 10
# A decode graph marks its inputs read by an external event's record node, so the host may restage them while the
# step still runs. False (`profile_decode --ab no_staged_event`, timing only: the host then restages without
# waiting): no such node. The step times the same without it, and a kernel writing a pinned word the host polls in
# its place timed the same too (H100, b1 1K and 32K). The ~8 µs a profiled step shows after its input kernel comes
# with any branch forking there, and is mostly the profiler's: 1-2 µs unprofiled in small graphs
# (bench/probe_graph_gap.py; bench/RESULTS.md fifty-seventh session).
STAGED_EVENT = True


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    hidden: torch.Tensor  # the final hidden rows [bucket, H] (speculative decoding's MTP layer reads them)
    static_counts: dict[str, float]  # collective calls/bytes one eager run of this bucket made (they do not
    # depend on the batch's contents); each replay adds them again


class CudaGraphRunner:
    """`moe_gather`: DP-attention — the graphs are captured with every rank's batch padded to the bucket and the
    MoE layers' all-gather / reduce-scatter inside (engine/dp_step.py); `replay` then takes the agreed bucket.
    `future_token_ids`: overlap scheduling — placeholder input ids resolve inside the graph."""

    replay_counter = "graph_replays"
    mtp_layer = -1  # the main forward's; a subclass's graphs run MTP layer 0 (engine/mtp_graphs.py)

    def __init__(self, model, pool, max_bs: int, max_pages_per_req: int, sink_page: int,
                 future_token_ids: torch.Tensor | None = None, moe_gather: bool = False,
                 logits_out: torch.Tensor | None = None, table_rows: int = 0):
        self.model, self.pool, self.page_size, self.moe_gather = model, pool, pool.page_size, moe_gather
        self.future_token_ids = future_token_ids
        self.max_bs, self.max_pages, self.sink_page = max_bs, max_pages_per_req, sink_page
        self.table_rows = table_rows  # the batch builder's rows (the mirror's keys), where known
        self.buckets = decode_buckets(max_bs)
        dev = pool.kv_buffer.device
        # The H2D copy is a node of each graph where the driver allows it (probed): the replay is then the
        # step's only CUDA call (the H200 host measured ~60-130 us for a separate copy call and its event)
        self.copy_in_graph = dev.type == "cuda" and _graph_h2d_copy_works(dev)
        self.max_deltas = self._max_deltas(dev)
        # The static inputs are views of one int64 buffer (5 per-token rows, then the page table), so a host
        # batch reaches them in one H2D copy from a pinned twin: each CUDA call is host time the GPU idles
        # through before the replay starts (tens of us each on the H200's host), and this was 14 of them. With
        # the page table on the device (`mirror`) a 6th row (the mirror's row each batch row reads) precedes the
        # table (padded to keep the table's alignment) and the staged changes follow it.
        self.input_rows = INPUT_ROWS + bool(self.max_deltas)
        self.table_start = self.input_rows * max_bs + bool(self.max_deltas) * (max_bs % 2)
        table_end = self.table_start + max_bs * max_pages_per_req
        self.changes_start = table_end + table_end % 2
        staged = self.changes_start + 1 + 2 * self.max_deltas if self.max_deltas else table_end
        self.inputs = torch.zeros(table_end, dtype=torch.int64, device=dev)
        self.host_inputs = torch.zeros(staged, dtype=torch.int64)
        if dev.type == "cuda":
            self.host_inputs = self.host_inputs.pin_memory()
        self.mirror = None if not self.max_deltas else PageTableMirror(
            max(table_rows, max_bs), max_pages_per_req, sink_page, self.host_inputs.numpy()[self.changes_start:], dev)
        # the buckets whose graphs read the page table from the mirror (fixed here: each graph captures its way)
        self.mirrored = {b for b in self.buckets if self.mirror is not None and self._mirrors(b)}
        self._views(self.host_inputs)[5].fill_(sink_page)  # columns past a batch's width: never real pages
        self.host_np = self._views(self.host_inputs.numpy())  # numpy writes: ~10x less host time than torch's
        # Recorded once the last step's copy has read the pinned twin: a node of each graph beside its copy
        # (an external event), so a step staged while the one before still runs (overlap scheduling, back-to-back
        # replays) waits for that step's copy, not for the whole step
        self.staged = torch.cuda.Event(external=True) if dev.type == "cuda" else None
        # The copy in the graph is a kernel reading the pinned buffer where the registry's passes the same probe:
        # the step's kernels then start a few µs sooner than after a copy node (`triton_elementwise.copy_from_host`)
        self.copy_inputs = _copy_node
        if self.copy_in_graph and _graph_h2d_copy_works(dev, get_ops(dev).copy_from_host):
            self.copy_inputs = get_ops(dev).copy_from_host
        (self.input_ids, self.positions, self.req_index, self.seq_lens, self.out_cache_loc,
         self.page_table, *mirror_rows) = self._views(self.inputs)
        self.mirror_rows = mirror_rows[0] if mirror_rows else None  # the mirror's row each batch row reads
        self.extend_lens = torch.ones(max_bs, dtype=torch.int64, device=dev)
        # every row's logits row: made once here, not by an arange inside each capture (a kernel every replay)
        self.logits_indices = torch.arange(max_bs, device=dev)
        # Every bucket's graph writes its logits into one buffer (`logits_out`, shareable between runners whose
        # replays never overlap), not a [bucket, V] tensor of its own kept in the pool: summed over the buckets
        # those came to 2.5 GiB a width class at GLM-5.3's vocabulary with 512 rows (3 drafts), twice under TP's
        # float32 gather
        self.logits_out = logits_out  # made by `capture` where not given (or not the lm_head's dtype)
        self.graphs: dict[int, _Graph] = {}
        self.pool_handle = None
        self.capture_seconds = 0.0
        self.capture_retries = 0  # buckets captured again after an eager run (capture(warm_each=False))

    def _max_deltas(self, dev: torch.device) -> int:
        """How many page-table changes a step stages (0: every bucket copies its whole table each step): one
        request joining at the class's full width and a new page for every row."""
        if not (TABLE_MIRROR and self.copy_in_graph and self._mirrors(self.max_bs)):
            return 0
        return self.max_pages + 2 * self.max_bs if _stage_op_works(dev, get_ops(dev).stage_from_host) else 0

    def _mirrors(self, bucket: int) -> bool:
        """Whether a bucket's page table is large enough to be read from the mirror (else copied whole)."""
        return bucket * self.max_pages * 8 > TABLE_MIRROR_MIN_BYTES

    def _views(self, buf):
        """(input_ids, positions, req_index, seq_lens, out_cache_loc, page_table) inside buf (a tensor or
        its numpy view), then with the mirror the row of it each batch row reads."""
        n = self.max_bs
        rows = [buf[i * n:(i + 1) * n] for i in range(self.input_rows)]
        table = buf[self.table_start:self.table_start + n * self.max_pages].reshape(n, self.max_pages)
        return (*rows[:INPUT_ROWS], table, *rows[INPUT_ROWS:])

    def _static_batch(self, bs: int) -> ForwardBatch:
        ones = [1] * bs
        return ForwardBatch(self.input_ids[:bs], self.positions[:bs], self.req_index[:bs], self.seq_lens[:bs],
                            self.extend_lens[:bs], self.page_table[:bs], self.out_cache_loc[:bs],
                            self.logits_indices[:bs], self.page_size, ones, ones,
                            dp_rows=bs if self.moe_gather else 0, future_token_ids=self.future_token_ids)

    def _reset_padding(self, start: int, end: int | None = None, host: bool = False, table: bool = True) -> None:
        """Rows [start, end) become padding: position 0 of their own dummy request, KV to the sink page, its page
        table the sink's (table False: only the mirror's sink row; in the host staging buffer with host=True, else
        on the device)."""
        end = self.max_bs if end is None else end
        if start >= end:
            return
        ids, pos, req, lens, out, pages, *keys = self.host_np if host else (
            self.input_ids, self.positions, self.req_index, self.seq_lens, self.out_cache_loc, self.page_table,
            self.mirror_rows)
        ids[start:end] = 0
        pos[start:end] = 0
        lens[start:end] = 1
        req[start:end] = np.arange(start, end) if host else torch.arange(start, end, device=req.device)
        if table:
            pages[start:end] = self.sink_page
        if self.mirror is not None:
            keys[0][start:end] = self.mirror.sink_row
        out[start:end] = self.sink_page * self.page_size

    def capture(self, warm_each: bool = True) -> list[int]:
        """Warm each bucket eagerly (compiles kernels, records its collectives), then capture; largest first
        so smaller graphs reuse the largest one's memory pool. warm_each=False (a warm start whose preload
        loaded every recorded kernel): only the largest bucket runs eagerly first, the rest are captured
        straight away; a bucket whose capture fails so, or a run that makes collectives, is warmed as before."""
        t0 = time.perf_counter()
        rows, vocab, dtype = self.max_bs, self.model.cfg.vocab_size, self.model.logits_dtype()
        buf = self.logits_out
        if buf is None or buf.dtype != dtype or buf.shape[0] < rows or buf.shape[1] != vocab:
            # none given, or the lm_head's dtype changed since (profile_decode's A/B captures again)
            self.logits_out = torch.empty(rows, vocab, dtype=dtype, device=self.inputs.device)
        self._reset_padding(0)
        stream = torch.cuda.Stream(self.input_ids.device)  # the captures' side stream (synchronized before each)
        branch = torch.cuda.Stream(self.input_ids.device)  # inside each capture: `staged`'s record, off the chain
        self.capture_retries = 0
        for i, bs in enumerate(sorted(self.buckets, reverse=True)):
            static, (graph, logits, hidden), _, retried = capture_bucket(
                lambda bs=bs: self._warm(bs), lambda bs=bs: self._capture_one(bs, stream, branch), warm_each or i == 0)
            warm_each = warm_each or bool(static)  # collectives: their counts are each bucket's own
            self.capture_retries += retried
            if self.pool_handle is None:
                self.pool_handle = graph.pool()
            self.graphs[bs] = _Graph(graph, logits, hidden, static)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        return sorted(self.graphs)

    def _warm(self, bs: int) -> dict[str, float]:
        """One eager run of the bucket's shapes (first-use work outside the capture); the collectives it made."""
        before = COUNTERS.host_values()  # device-side counters replay inside the graph by themselves
        self._forward(bs)
        static = {k: v for k, v in Counters.diff(COUNTERS.host_values(), before).items()
                  if k.startswith("collective_")}
        COUNTERS.restore(before)  # startup work is not traffic
        return static

    def _capture_one(self, bs: int, stream: torch.cuda.Stream,
                     branch: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        enabled, COUNTERS.enabled = COUNTERS.enabled, False  # capture-time Python must not count
        try:
            with lean_capture(graph, self.pool_handle, stream):
                if self.copy_in_graph:
                    self._copy_staged(bs)
                    branch.wait_stream(stream)
                    # a node beside the step's kernels, after the copy (in the step's chain instead: the same step
                    # times, b1 and b128 1K, H100, bench/RESULTS.md forty-seventh session)
                    if STAGED_EVENT:
                        self.staged.record(branch)
                try:
                    logits, hidden = self._forward(bs)
                finally:  # the branch joins at the end (nothing of the step waits on it), raised or not
                    if self.copy_in_graph:
                        stream.wait_stream(branch)
        finally:
            COUNTERS.enabled = enabled
        return graph, logits, hidden

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final hidden rows) of the main model over the static inputs of bucket `bs` (what a graph runs
        after its inputs landed; the placeholder ids resolved by the model's first launch: `_static_batch`)."""
        return self.model(self._static_batch(bs), self.pool, logits_out=self.logits_out[:bs])

    def fallback_reason(self, batch: ForwardBatch, bucket: int | None = None) -> str | None:
        """None if this batch can replay a graph (of `bucket`, when the DP ranks agreed on one), else why it
        runs eager (counted by reason). A batch of no requests (an idle DP rank's) replays padding only."""
        if not self.graphs:
            return "no_graphs"
        seq_lens, ext = batch.host_lens()
        if ext and all(n != 1 for n in ext):
            return "prefill"  # the piecewise graphs' (engine/piecewise_runner.py), or eager
        if any(n != 1 for n in ext):
            return "mixed_prefill_decode"
        if batch.prompt_rows is not None:
            return "prompt_logprobs"  # a 1-token chunk inside a prompt: its hidden row is read after the step
        if len(ext) > self.max_bs or (bucket is not None and bucket not in self.graphs):
            return "batch_over_max_bs"
        if batch.page_table.shape[1] > self.max_pages:
            return "context_over_capture"
        return None

    def replay(self, batch: ForwardBatch, bucket: int | None = None) -> torch.Tensor:
        """Logits of the batch's logits rows (the graph of `bucket`, default the smallest that holds the
        batch). When every row samples (decode) they are a view of the graph's output buffer: valid until the
        next replay (the engine samples before it builds the next step)."""
        return self.replay_with_hidden(batch, bucket)[0]

    def replay_with_hidden(self, batch: ForwardBatch, bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(`replay`'s logits, the batch's final hidden rows [bs, H]): views of the graph's buffers, valid until the
        next replay."""
        logits, hidden = self.replay_all_rows(batch, bucket)
        # a 1-token row may be a prefill chunk that is not its prompt's end: only logits_indices rows sample
        if batch.samples_every_token:
            return logits, hidden
        return logits.index_select(0, self.logits_rows(batch)), hidden

    def replay_all_rows(self, batch: ForwardBatch, bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, final hidden rows) of every row of the batch: views of the graph's buffers."""
        bs = batch.batch_size
        bucket = bucket or next(b for b in self.buckets if b >= bs)
        if batch.input_ids.is_cuda and not self.copy_in_graph:
            self._load_device(batch, bs, bucket)
        else:
            self._load_host(batch if not batch.input_ids.is_cuda else batch.to("cpu"), bs, bucket)
        g = self.graphs[bucket]
        g.graph.replay()
        self._count(batch, g)
        return g.logits[:bs], g.hidden[:bs]

    def logits_rows(self, batch: ForwardBatch) -> torch.Tensor:
        """The batch's logits rows on the device, queued behind the replay (a pageable copy would wait for it)."""
        return to_device(batch.logits_indices, torch.int64, self.inputs.device)

    def _load_host(self, batch: ForwardBatch, bs: int, bucket: int) -> None:
        """Host batch (the engine's): fill the pinned staging buffer, then one H2D copy (a node of the graph
        itself when `copy_in_graph`)."""
        # until the previous step's copy has read the buffer (its step may still run)
        if self.staged is not None and STAGED_EVENT:
            self.staged.synchronize()
        ids, pos, req, lens, out, table, *keys = self.host_np
        ids[:bs] = batch.input_ids.numpy()
        pos[:bs] = batch.positions.numpy()
        req[:bs] = batch.req_index.numpy()
        lens[:bs] = batch.seq_lens.numpy()
        out[:bs] = batch.out_cache_loc.numpy()
        mirrored = bucket in self.mirrored
        if mirrored:
            self._stage_table(batch, bs, keys[0])
        else:
            table[:bs, : batch.page_table.shape[1]] = batch.page_table.numpy()
        self._reset_padding(bs, bucket, host=True, table=not mirrored)  # only this bucket's padding rows are read
        if not self.copy_in_graph:
            self._copy_staged(bucket)
            if self.staged is not None:
                self.staged.record()

    def _stage_table(self, batch: ForwardBatch, bs: int, keys: np.ndarray) -> None:
        """The batch's page-table changes into the staged inputs, each row's mirror row into `keys` (the host's)."""
        rows = self.mirror.keys(batch.table_rows, bs)
        keys[:bs] = np.arange(bs) if rows is None else rows
        need = -(-batch.seq_lens.numpy() // self.page_size)
        gens = None if rows is None else batch.table_gens
        if not self.mirror.stage(batch.page_table.numpy(), rows, gens, need):  # too many changes: the whole twin
            self.mirror.copy_whole()

    def _copy_staged(self, bucket: int) -> None:
        """The per-token rows and the bucket's page-table rows (with the mirror: the table's staged changes into
        it, then the bucket's rows gathered from it): host staging -> the graph's inputs."""
        if bucket in self.mirrored:
            rows = self.input_rows * self.max_bs
            get_ops(self.inputs.device).stage_from_host(self.inputs[:rows], self.host_inputs[:rows],
                                                        self.mirror.device.view(-1),
                                                        self.host_inputs[self.changes_start:], self.max_deltas)
            torch.index_select(self.mirror.device, 0, self.mirror_rows[:bucket], out=self.page_table[:bucket])
            return
        n = self.table_start + bucket * self.max_pages
        self.copy_inputs(self.inputs[:n], self.host_inputs[:n])

    def _load_device(self, batch: ForwardBatch, bs: int, bucket: int) -> None:
        """A batch already on the device: copy each field into the static buffers."""
        self._reset_padding(bs, bucket)
        for dst, src in ((self.input_ids, batch.input_ids), (self.positions, batch.positions),
                         (self.req_index, batch.req_index), (self.seq_lens, batch.seq_lens),
                         (self.out_cache_loc, batch.out_cache_loc)):
            dst[:bs].copy_(src, non_blocking=True)
        self.page_table[:bs, : batch.page_table.shape[1]].copy_(batch.page_table, non_blocking=True)

    def _count(self, batch: ForwardBatch, g: _Graph) -> None:
        """What the eager forward counts: the step's bytes (`model/step_counts.py`, the same call), and the
        collectives the warmup run of this bucket made (their Python does not run in a replay)."""
        COUNTERS.add(self.replay_counter)
        for k, v in g.static_counts.items():
            COUNTERS.add(k, v)
        count_step(self.model.forward_shape(self.mtp_layer), self.pool, batch, pages=self.max_pages)  # captured width
