"""The split radix select (kernels/triton_indexer_long.py) against the one-program row select
(`triton_indexer._topk_select_kernel`), bit for bit, on the rows that stress its branches: ties (few values,
all equal), rows rising along the context (the top keys in the last chunks: earlier chunks match nothing from
round 1 on), tokens that see exactly k, k + 1 and k - 1 keys, positions at chunk boundaries, and rows whose
k-th key's bucket is taken whole at each round 0..2 (and 3: full 32-bit ties taken in part). Small shapes:
they run under the Triton interpreter (TRITON_INTERPRET=1 DSASERVE_TEST_TRITON_INTERPRET=1) or on CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernels.gpu_common import DEVICE, requires_gpu_kernels

pytestmark = requires_gpu_kernels

K, CHUNK, PS, WIDTH = 64, 256, 16, 1536


def _from_keys(u: torch.Tensor) -> torch.Tensor:
    """Positive float32 scores whose uint32 order keys are u (u in [2^31 + 2^23, 2^31 + 2^30))."""
    return (u - 2**31).to(torch.int32).view(torch.float32)


def _resolved_at(r: int, gen: torch.Generator, n: int) -> torch.Tensor:
    """A row whose top K keys have byte r = 0x41 and the rest 0x40 (the bytes above r equal, those below random):
    the k-th key's 8(r + 1)-bit bucket holds exactly K keys, so the search ends at round r."""
    shift = 24 - 8 * r
    low = torch.randint(0, 2**shift, (n,), generator=gen, dtype=torch.int64)
    digit = torch.full((n,), 0x40, dtype=torch.int64)
    digit[torch.randperm(K + 1, generator=gen)[:K]] = 0x41  # seen by every token at position >= K
    hi = (0xB0A09080 >> (32 - 8 * r) << (32 - 8 * r)) if r else 0x80 << 24
    return _from_keys(hi + (digit << shift) + low)


def _rows(kind: str, gen: torch.Generator, n: int) -> torch.Tensor:
    s = torch.randn(n, generator=gen)
    if kind == "ties":
        return (s * 2).round()
    if kind == "all_equal":
        return torch.full((n,), 1.5)
    if kind == "rising":
        return torch.linspace(0, 10, n) + 0.01 * s
    if kind.startswith("round"):
        return _resolved_at(int(kind[-1]), gen, n)
    if kind == "outlier":  # one key 2^40 x the others: the k-th key's digit lies below the window pass's bins
        s[n // 3] = 2.0 ** 40
    return s


def triton_indexer_long_state(name: str) -> int:
    """Column of a state field in the rows' state (the workspace from STATE on)."""
    from dsaserve.kernels import triton_indexer_long

    return getattr(triton_indexer_long, name).value


def _select_both(scores: torch.Tensor, pos: torch.Tensor, chunk: int, k: int = K,
                 table_keys: int | None = None, window: bool = True,
                 late_slots: bool = False, coop: bool = False) -> tuple[torch.Tensor, ...]:
    """(split select, row select, the rows' search state) of the same scores, outputs pre-filled with -7 (a column
    left unwritten shows). After every launch each row's arrival counter is back at 0 (the next launch, or a
    graph's next replay, finds it there). table_keys: the page table's width in keys (default: the row's)."""
    from dsaserve.kernels import triton_indexer, triton_indexer_coop, triton_indexer_long

    n, width = scores.shape
    pages = (table_keys or width) // PS
    table = torch.randperm(n * pages, device=DEVICE).view(n, -1)
    req = torch.arange(n, device=DEVICE)
    got = torch.full((n, k), -7, dtype=torch.int64, device=DEVICE)
    if coop:
        steps = [triton_indexer_coop.launch(scores, table, req, pos, got, k, PS, chunk)]
    else:
        steps = triton_indexer_long.launches(scores, table, req, pos, got, k, PS, chunk, window, late_slots)
    ws = steps[0][2][4 if coop else 2]
    for kernel, grid, args, kwargs in steps:
        kernel[grid](*args, **kwargs)
        assert ws[:, triton_indexer_long.STATE.value + 4].eq(0).all(), f"{kernel.fn.__name__}: a counter not reset"
    state = ws[:, triton_indexer_long.STATE:]  # the rows' search state (prefix, need, shift, done, ...)
    want = torch.full((n, k), -7, dtype=torch.int64, device=DEVICE)
    grid, args, kwargs = triton_indexer.row_select_launch(scores, table, req, pos, want, width, k, PS)
    triton_indexer._topk_select_kernel[grid](*args, **kwargs)
    return got, want, state


@pytest.mark.parametrize("kind", ["normal", "ties", "all_equal", "rising", "round0", "round1", "round2", "round3",
                                  "outlier"])
@pytest.mark.parametrize("window,late_slots", [(False, False), (True, False), (True, True)],
                         ids=["plain", "window", "window+late-slots"])
def test_the_split_select_equals_the_row_select(kind, window, late_slots):
    gen = torch.Generator().manual_seed(hash(kind) % 2**31)
    # positions: k - 1 (takes all), k (k + 1 keys), chunk boundaries, the last key
    pos = torch.tensor([K - 1, K, CHUNK - 1, CHUNK, 2 * CHUNK + 7, WIDTH - 1], device=DEVICE)
    scores = torch.stack([_rows(kind, gen, WIDTH) for _ in range(len(pos))]).to(DEVICE)
    if kind == "round3":  # 32-bit ties at the k-th key taken in part: some chunks rank their ties
        scores[:, ::3] = 2.5
    got, want, state = _select_both(scores, pos, CHUNK, window=window, late_slots=late_slots)
    assert torch.equal(got, want)
    if kind in ("round0", "round1", "round2"):  # the rows that search (position >= k) ended at that round
        r = int(kind[-1])
        assert state[1:, 2].tolist() == [24 - 8 * r] * (len(pos) - 1) and state[1:, 3].eq(1).all()
    assert (got[1:] >= 0).all()
    # rows of >= CHUNK keys: the window pass chose round 0's digit, but where one key dwarfs the rest (its digit 10
    # above theirs: round 0 counted every key); the outlier is seen from position n // 3 = 512 on. (The row at
    # position k takes 64 of 65 keys: its k-th key is near the bottom, below the window: round 0 ran there.)
    window_done = state[2:, triton_indexer_long_state("WINDOW_DONE")].tolist()
    assert window_done == [int(window and (kind != "outlier" or p < WIDTH // 3)) for p in pos[2:].tolist()]


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="a barrier among a launch's programs: the interpreter runs them one after another")
@pytest.mark.parametrize("kind", ["normal", "ties", "all_equal", "rising", "round0", "round1", "round2", "round3"])
@pytest.mark.parametrize("poll,count_poll", [(True, True), (False, True), (True, False), (False, False)])
def test_the_cooperative_select_equals_the_row_select(kind, poll, count_poll, monkeypatch):
    """One launch with barriers among a row's programs (`triton_indexer_coop`, decode's 1-2 rows) writes what the
    row select does, bit for bit, on the same rows (6 rows x 6 chunks: every program resident at once), each round's
    histogram polled until complete (`HIST_POLL`) or behind a barrier, the chunks' counts polled as tagged words
    (`COUNT_POLL`) or exchanged behind one."""
    from dsaserve.kernels import triton_indexer_coop

    monkeypatch.setattr(triton_indexer_coop, "HIST_POLL", poll)
    monkeypatch.setattr(triton_indexer_coop, "COUNT_POLL", count_poll)
    gen = torch.Generator().manual_seed(hash(kind) % 2**31 + 1)
    pos = torch.tensor([K - 1, K, CHUNK - 1, CHUNK, 2 * CHUNK + 7, WIDTH - 1], device=DEVICE)
    scores = torch.stack([_rows(kind, gen, WIDTH) for _ in range(len(pos))]).to(DEVICE)
    if kind == "round3":
        scores[:, ::3] = 2.5
    for _ in range(3):  # again: each launch's barrier counters start from zero
        got, want, _ = _select_both(scores, pos, CHUNK, coop=True)
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="a barrier among a launch's programs: the interpreter runs them one after another")
@pytest.mark.parametrize("positions", [(WIDTH - 1,), (WIDTH - 1, 2 * CHUNK + 7), (K - 1, CHUNK)])
@pytest.mark.parametrize("kind", ["normal", "round1", "round3"])
@pytest.mark.parametrize("count_poll", [True, False])
def test_the_cooperative_select_leaves_the_shared_workspace_ready(kind, positions, count_poll, monkeypatch):
    """Decode's 1-2 rows select over the workspace every cooperative launch shares (`coop_workspace`: no fill launch
    before them): each launch leaves it as the next must find it (`ready_for_next_launch`), so launch after launch
    (a graph's replays, the next full layer) selects what the row select does; a row that takes every key (position
    k - 1) beside one that selects. Rows whose programs differ from launch to launch (chunks past the position are
    idle) must not read a count word an earlier launch left (`COUNT_POLL`: the two buffers taken in turn)."""
    from dsaserve.kernels import triton_indexer_coop

    monkeypatch.setattr(triton_indexer_coop, "COUNT_POLL", count_poll)
    gen = torch.Generator().manual_seed(hash(kind) % 2**31 + 2)
    rows = len(positions)
    scores = torch.stack([_rows(kind, gen, WIDTH) for _ in range(rows)]).to(DEVICE)
    if kind == "round3":
        scores[:, ::3] = 2.5
    shared = triton_indexer_coop.coop_workspace(scores.device)
    kernel, grid, args, _ = triton_indexer_coop.launch(scores, torch.zeros(rows, WIDTH // PS, dtype=torch.int64,
                                                                          device=DEVICE),
                                                       torch.arange(rows, device=DEVICE),
                                                       torch.tensor(positions, device=DEVICE),
                                                       torch.empty(rows, K, dtype=torch.int64, device=DEVICE), K,
                                                       PS, CHUNK)
    assert args[4].data_ptr() == shared.data_ptr()  # the shared rows, not a zeroed workspace of its own
    # the same positions again, then fewer chunks, more, one, and back: each launch's programs differ from the last's
    for step in (0, 0, 0, -3 * CHUNK, 0, -(WIDTH - 1 - CHUNK), -2 * CHUNK - 5, 0):
        pos = torch.tensor([max(p + step, K - 1) if p >= K else p for p in positions], device=DEVICE)
        got, want, _ = _select_both(scores, pos, CHUNK, coop=True)
        assert torch.equal(got, want), f"positions {pos.tolist()}"
        assert triton_indexer_coop.ready_for_next_launch(shared)


def test_the_cooperative_launch_is_refused_where_its_programs_might_not_all_be_resident():
    """More programs than SMs (or the interpreter, which runs them one by one): an error, never a launch that could
    wait forever at its first barrier."""
    from dsaserve.kernels import triton_indexer_coop

    n_chunks = 1000
    scores = torch.empty(1, n_chunks * 128, device=DEVICE)
    args = (torch.zeros(1, n_chunks * 128 // PS, dtype=torch.int64, device=DEVICE), torch.zeros(1, dtype=torch.int64,
            device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE), torch.empty(1, K, dtype=torch.int64,
            device=DEVICE))
    assert not triton_indexer_coop.cooperative(1, n_chunks * 128, 128, scores)
    with pytest.raises(ValueError, match="cooperative"):
        triton_indexer_coop.launch(scores, *args, K, PS, 128)


def test_a_token_that_sees_fewer_than_k_keys_gets_all_k_columns_written_past_the_rows_chunks():
    """k = 300 columns over rows of one 128-key chunk (a radix chunk below top-k, as sweep configs can ask): the
    grid's chunks take the k columns in turns, as the row select writes them (the review of the rewrite found
    columns 128..299 unwritten)."""
    gen = torch.Generator().manual_seed(11)
    scores = torch.randn(2, 128, generator=gen).to(DEVICE)
    for late_slots in (False, True):
        got, want, _ = _select_both(scores, torch.tensor([100, 127], device=DEVICE), 128, k=300, table_keys=512,
                                    late_slots=late_slots)
        assert torch.equal(got, want) and not (got == -7).any()


@pytest.mark.parametrize("chunk", [0, 64, 384])
def test_a_chunk_that_is_not_a_power_of_two_of_128_or_more_is_refused(chunk):
    from dsaserve.kernels import triton_indexer_long

    scores = torch.zeros(1, 1024, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        triton_indexer_long.launches(scores, torch.zeros(1, 64, dtype=torch.int64, device=DEVICE),
                                     torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                     torch.zeros(1, dtype=torch.int64, device=DEVICE),
                                     torch.empty(1, K, dtype=torch.int64, device=DEVICE), K, PS, chunk)

