"""A wide decode graph's page table kept on the device by request row (engine/page_table_mirror.py), on the CPU: the
staged changes, applied by the reference `stage_from_host` and gathered by the batch's keys as the graph does, give
each batch its pages; only what changed is staged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsaserve.engine.page_table_mirror import PageTableMirror
from dsaserve.kernels import reference as R

SINK = 999


def _mirror(rows: int, max_pages: int, max_deltas: int) -> tuple[PageTableMirror, torch.Tensor]:
    staged = torch.zeros(1 + 2 * max_deltas, dtype=torch.int64)
    return PageTableMirror(rows, max_pages, SINK, staged.numpy(), torch.device("cpu")), staged


def _replay(m: PageTableMirror, staged: torch.Tensor, fits: bool, keys: np.ndarray, bucket: int) -> torch.Tensor:
    """What the replay reads as its table: the kernel's changes (or the caller's copy of the whole twin), then the
    rows gathered by key, padding rows from the sink row."""
    if fits:
        none = torch.zeros(0, dtype=torch.int64)
        R.stage_from_host(none, none, m.device.view(-1), staged, m.max_deltas)
    else:
        m.copy_whole()
    rows = torch.full((bucket,), m.sink_row, dtype=torch.int64)
    rows[:keys.size] = torch.from_numpy(keys)
    return m.device.index_select(0, rows)


def _need(rows: np.ndarray) -> np.ndarray:
    return (rows != SINK).sum(axis=1)  # the tests' rows hold their pages, then SINK to the batch's width


def test_a_decode_step_stages_only_a_new_page_and_a_request_leaving_moves_no_other_row():
    m, staged = _mirror(rows=6, max_pages=8, max_deltas=8 + 8)
    batch = np.array([[1, 2, SINK], [3, 4, 5], [6, SINK, SINK]])
    keys, gens = m.keys(np.array([4, 0, 2]), 3), np.array([1, 1, 1])
    assert keys.tolist() == [4, 0, 2]
    assert m.stage(batch, keys, gens, _need(batch)) and staged[0] == 6  # three new requests: their pages
    table = _replay(m, staged, True, keys, 4)
    assert torch.equal(table[:3, :3], torch.from_numpy(batch)) and (table[3] == SINK).all()
    batch[0, 2] = 7  # one request crossed into a new page
    assert m.stage(batch, keys, gens, _need(batch)) and staged[0] == 1
    assert staged[1] == 4 * 8 + 2 and staged[1 + m.max_deltas] == 7
    _replay(m, staged, True, keys, 4)
    fewer = batch[[0, 2]]  # the request in the middle left: the others keep their rows, nothing is staged
    assert m.stage(fewer, keys[[0, 2]], gens[[0, 2]], _need(fewer)) and staged[0] == 0
    table = _replay(m, staged, True, keys[[0, 2]], 2)
    assert torch.equal(table[:, :3], torch.from_numpy(fewer))
    fewer[1, 0] = 8  # a new request took row 2 (its generation 2): all its pages, though one matches the old
    assert m.stage(fewer, keys[[0, 2]], np.array([1, 2]), _need(fewer)) and staged[0] == 1
    assert torch.equal(_replay(m, staged, True, keys[[0, 2]], 2)[:, :3], torch.from_numpy(fewer))


def test_keys_fall_back_to_the_batch_rows_compared_whole_and_an_overflow_copies_the_whole_twin():
    m, staged = _mirror(rows=4, max_pages=8, max_deltas=2)
    assert m.keys(None, 3) is None
    assert m.keys(np.array([1, 1, 2]), 3) is None  # not distinct
    assert m.keys(np.array([0, 4]), 2) is None  # the sink row is no request's
    assert m.keys(np.array([3]), 2) is None  # not one a row
    batch = np.array([[1, 2, 3], [4, 5, 6]])
    assert not m.stage(batch, None, None, _need(batch)) and staged[0] == 0  # 6 changes, 2 fit
    table = _replay(m, staged, False, np.arange(2), 2)
    assert torch.equal(table[:, :3], torch.from_numpy(batch))
    batch[1, 0] = 9
    assert m.stage(batch, None, None, _need(batch)) and staged[0] == 1  # compared: the one entry that differs
    assert torch.equal(_replay(m, staged, True, np.arange(2), 2)[:, :3], torch.from_numpy(batch))


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_give_each_batch_its_pages(seed):
    """A batch builder's rows: requests take free rows (a new generation), grow a page at a time and leave; the
    batch order changes; steps come keyed by the builder's rows and generations or (some, and every step of odd
    seeds) by their own rows, compared. Each replay's table holds the batch's pages, its padding rows the sink, the
    device's copy the twin; most steps stage their changes."""
    r = np.random.default_rng(seed)
    rows, max_bs, max_pages = 10, 8, 12
    m, staged = _mirror(rows, max_pages, max_deltas=max_pages + 2 * max_bs)
    table, gens = np.full((rows, max_pages), SINK), np.zeros(rows, dtype=np.int64)
    lens = np.zeros(rows, dtype=np.int64)

    def take(row: int) -> None:
        gens[row] += 1
        lens[row] = r.integers(1, max_pages)
        table[row, :lens[row]] = r.integers(0, 500, lens[row])

    for row in range(rows):
        take(row)
    live: list[int] = []
    fitted = 0
    for step in range(60):
        if not live or r.random() < 0.3:
            live = list(r.choice(rows, size=r.integers(1, max_bs + 1), replace=False))
        for row in live:
            if r.random() < 0.3 and lens[row] < max_pages:
                table[row, lens[row]] = r.integers(0, 500)
                lens[row] += 1
        if r.random() < 0.1:
            take(int(r.choice(rows)))
        if r.random() < 0.2:
            live = list(r.permutation(live))
        width = int(lens[live].max())
        batch = table[live, :width]  # a new request's row keeps the old one's pages past its own: as the builder's
        keyed = seed % 2 == 0 and r.random() < 0.8
        keys = m.keys(np.array(live), len(live)) if keyed else None
        bucket = min(max_bs, 1 << (len(live) - 1).bit_length())
        fits = m.stage(batch, keys, gens[live] if keyed else None, lens[live])
        fitted += fits
        got = _replay(m, staged, fits, np.arange(len(live)) if keys is None else keys, bucket)
        for i, row in enumerate(live):
            assert torch.equal(got[i, :lens[row]], torch.from_numpy(table[row, :lens[row]])), f"step {step}"
        assert (got[len(live):] == SINK).all(), f"step {step}"
        assert torch.equal(m.device, m.host), f"step {step}: the device's copy left the twin"
    assert fitted >= 30


@pytest.mark.parametrize("caching", [True, False])
def test_the_engines_batches_keyed_by_builder_row_and_generation_read_their_pages_through_preemption(caching):
    """The engine's own batches (fake runner: a pool so small that requests are preempted and take other rows, prefix
    caching on and off, requests finishing mid-batch): each step's changes staged by builder row and generation, then
    gathered by row as a graph does, give every row the pages its length covers, as the batch's table has them."""
    from tests.engine.fake_runner import FakeRunner, prompts
    from tests.engine.test_scheduler import add, make_core, run

    core = make_core(num_pages=8, max_num_batched_tokens=64, chunked_prefill_size=32, max_running_requests=6,
                     enable_prefix_caching=caching)
    max_pages = core.scheduler.max_pages_per_seq
    m, staged = _mirror(6, max_pages, max_deltas=max_pages + 2 * 6)
    checked = []
    forward = FakeRunner.forward

    def check(runner, batch):
        rows, width = batch.page_table.shape
        keys = m.keys(batch.table_rows, rows)
        need = -(-np.asarray(batch.host_lens()[0]) // batch.page_size)
        fits = m.stage(batch.page_table.numpy(), keys, batch.table_gens, need)
        got = _replay(m, staged, fits, keys, rows)
        for i in range(rows):
            assert torch.equal(got[i, :need[i]], batch.page_table[i, :need[i]]), f"batch {len(checked)} row {i}"
        checked.append(fits)
        return forward(runner, batch)

    core.runner.forward = check.__get__(core.runner)
    for i, p in enumerate(prompts(16, 20, 150, seed=5)):
        add(core, f"r{i}", p, max_tokens=40, ignore_eos=True)
    run(core, max_steps=20_000)
    assert core.stats()["preemptions"] > 0 and len(checked) > 100 and sum(checked) > len(checked) // 2


def test_dummy_decode_batches_of_other_contexts_take_their_rows_anew():
    """The benches' batches (several contexts through one wide graph, `memory_profile.dummy_decode`): each batch's
    rows are a new generation, so a batch after another reads its own pages, not the columns the first left."""
    from dsaserve.engine.memory_profile import dummy_decode

    m, staged = _mirror(rows=4, max_pages=8, max_deltas=8 + 8)
    for context in (100, 300, 100):
        batch = dummy_decode(4, context, 64, "cpu")
        keys, need = m.keys(batch.table_rows, 4), -(-batch.seq_lens.numpy() // 64)
        fits = m.stage(batch.page_table.numpy(), keys, batch.table_gens, need)
        got = _replay(m, staged, fits, keys, 4)
        for i in range(4):
            assert torch.equal(got[i, :need[i]], batch.page_table[i, :need[i]]), f"context {context} row {i}"


def test_stage_from_host_copies_the_rows_and_writes_the_counted_changes_only():
    src, changes = torch.tensor([5, 6, 7]), torch.tensor([2, 1, 3, 9, 40, 50, 60])  # 2 of 3 pairs counted
    rows, table = torch.zeros(3, dtype=torch.int64), torch.zeros(10, dtype=torch.int64)
    R.stage_from_host(rows, src, table, changes, 3)
    assert rows.tolist() == [5, 6, 7] and table[1] == 40 and table[3] == 50 and table.count_nonzero() == 2
    with pytest.raises(ValueError, match="stage_from_host"):
        R.stage_from_host(rows, src, table, changes[:-1], 3)
    table.zero_()
    R.stage_from_host(rows, src, table, torch.tensor([5, -1, 10, 4, 7, 8, 9]), 3)  # count past 3; two outside
    assert table.tolist() == [0] * 4 + [9] + [0] * 5
    try:
        from dsaserve.kernels import triton_elementwise as E
    except ImportError:  # the CI's CPU torch may ship no Triton
        return
    rows.zero_(), table.zero_()
    E.stage_from_host(rows, src, table, changes, 3)  # not pinned: the reference
    assert rows.tolist() == [5, 6, 7] and table[1] == 40 and table[3] == 50 and table.count_nonzero() == 2
