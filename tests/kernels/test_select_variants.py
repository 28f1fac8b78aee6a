"""The indexer selection kernels' compiled variants (kernels/triton_indexer_long.py's split radix select,
kernels/triton_indexer.py's row select), compiled offline for sm_90 on the CPU (tests/offline_triton.py).

An eager prefill's score rows are as long as its context and its page table as wide as its longest request
(engine/batch.py), so a specialisation on either is a variant the warmup's shapes do not cover (the H200's
bench_gpu: `_chunk_write_kernel` compiled after Up for a 131072-token chunk): a variant per power of two of
the chunk count, and Triton's divisibility-by-16 classes of the chunk count and of the page-table width. One
chunk size (radix) or row block (rows) must give one variant of each kernel, whatever the row and the width.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

pytest.importorskip("triton")

from dsaserve.engine.kernel_precompile import SpecRecorder  # noqa: E402
from dsaserve.kernels import triton_indexer, triton_indexer_coop, triton_indexer_gemm, triton_indexer_long  # noqa: E402
from dsaserve.kernels.variants import fused_select_chunk  # noqa: E402
from tests.offline_triton import offline_jit  # noqa: E402

PS, TOPK = 64, 2048
LONG_KERNELS = (triton_indexer_long._top_digit_window_kernel, triton_indexer_long._radix_round_kernel,
                triton_indexer_long._chunk_count_kernel, triton_indexer_long._chunk_write_kernel,
                triton_indexer_long._positions_to_slots_kernel, triton_indexer_coop._coop_select_kernel,
                triton_indexer_coop._coop_score_select_kernel)


def _operands(width: int, rows: int = 2) -> tuple[torch.Tensor, ...]:
    """What the prefill select gets for one request `width` pages long (triton_indexer_gemm.gemm_topk: its
    workspace rows are the context rounded up to the 64-key score tile, the page table the batch's)."""
    return (torch.empty(rows, width * PS), torch.zeros(1, width, dtype=torch.int64),
            torch.zeros(rows, dtype=torch.int64), torch.zeros(rows, dtype=torch.int64),
            torch.empty(rows, TOPK, dtype=torch.int64))


def _kernel_counts(recorder: SpecRecorder) -> Counter:
    return Counter(json.loads(spec)["name"].rsplit(".", 1)[1] for spec in recorder.specs)


# page-table widths: the prefill warmup's 131072-token chunk with no context (2048 pages) and the core shapes'
# first width past the row-in-registers bound (272), then steps no warmup runs: a full chunk deep into the
# model's 202752-token context (3168), and contexts whose pages are not a multiple of 16 (chunk counts of every
# power-of-two class from 8 to 128)
RADIX_WIDTHS = (2048, 272, 3168, 3125, 513, 1025, 2047, 385)


def test_the_radix_select_compiles_one_variant_of_each_kernel_per_chunk_size(monkeypatch, tmp_path):
    offline_jit(monkeypatch, tmp_path / "triton", LONG_KERNELS)
    recorder = SpecRecorder(tmp_path / "specs.jsonl")
    chunks = (triton_indexer_gemm.DEFAULT_CONFIG["radix_chunk"], triton_indexer_long.CHUNK)  # prefill's, decode's
    for chunk in chunks:
        for width in RADIX_WIDTHS:
            for late_slots in (False, True):  # the write stores slots, or positions a last launch maps
                for kernel, grid, args, kwargs in triton_indexer_long.launches(
                        *_operands(width), TOPK, PS, chunk, window=True, late_slots=late_slots):
                    kernel.warmup(*args, grid=grid, **kwargs)
    for chunk in (1024, 2048, 4096):  # decode's 1-2 rows: one cooperative launch where rows x chunks fit the SMs
        for width, rows in ((512, 2), (513, 2), (2048, 1), (2048, 2), (3168, 1), (4095, 2)):
            ops = _operands(width, rows)
            if triton_indexer_coop.coop_fits(rows, -(-width * PS // chunk), ops[0]):
                kernel, grid, args, kwargs = triton_indexer_coop.launch(*ops, TOPK, PS, chunk)
                kernel.warmup(*args, grid=grid, **kwargs)
    fused = set()  # decode's 1-2 rows over the FP8 cache: scores and select in one launch, a variant per chunk
    for width, rows in ((257, 1), (512, 2), (513, 2), (2048, 1), (2048, 2), (3168, 1), (3168, 2), (4095, 1)):
        _, table, req, pos, out = _operands(width, rows)
        chunk = fused_select_chunk(rows, width * PS)
        q, w = torch.zeros(rows, 32, 128, dtype=torch.bfloat16), torch.zeros(rows, 32)
        cache = torch.zeros(width + 1, PS * 132, dtype=torch.uint8)
        kernel, grid, args, kwargs = triton_indexer_coop.score_select_launch(q, w, cache, table, req, pos, out, TOPK,
                                                                             PS, chunk)
        kernel.warmup(*args, grid=grid, **kwargs)
        fused.add(chunk)
    rounds = triton_indexer_long.ROUNDS
    assert _kernel_counts(recorder) == {"_top_digit_window_kernel": len(chunks), "_chunk_count_kernel": len(chunks),
                                        "_radix_round_kernel": rounds * len(chunks),
                                        "_chunk_write_kernel": 2 * len(chunks), "_positions_to_slots_kernel": 1,
                                        "_coop_select_kernel": 3, "_coop_score_select_kernel": len(fused)}


def test_the_row_select_compiles_one_variant_per_row_block_whatever_the_page_table_width(monkeypatch, tmp_path):
    """Rows up to ROW_IN_REGS_MAX keys (the prefill select's "auto" below the radix): the block is the row rounded up
    to a power of two (the warmup's core shapes run one width of each); the width's alignment must not matter."""
    offline_jit(monkeypatch, tmp_path / "triton", (triton_indexer._topk_select_kernel,))
    recorder = SpecRecorder(tmp_path / "specs.jsonl")
    blocks = {}
    for width in (48, 33, 64, 100, 128, 200, 255, 256):  # keys 2112 .. 16384: blocks 4096, 8192, 16384
        scores, table, req, pos, out = _operands(width)
        grid, args, kwargs = triton_indexer.row_select_launch(scores, table, req, pos, out, width * PS, TOPK, PS)
        triton_indexer._topk_select_kernel.warmup(*args, grid=grid, **kwargs)
        blocks[width] = kwargs["BLOCK"]
    assert sorted(set(blocks.values())) == [4096, 8192, 16384]
    assert _kernel_counts(recorder) == {"_topk_select_kernel": 3}


def test_the_stamped_score_select_compiles_with_its_clock_reads(monkeypatch, tmp_path):
    """bench/probe_select_phases.py's variant (STAMPS: %clock64 and %globaltimer at each phase, stored over the
    chunk's first scores) compiles for sm_90 beside the shipped one, and reads both timers in its PTX."""
    offline_jit(monkeypatch, tmp_path / "triton", (triton_indexer_coop._coop_score_select_kernel,))
    _, table, req, pos, out = _operands(513, 1)
    q, w = torch.zeros(1, 32, 128, dtype=torch.bfloat16), torch.zeros(1, 32)
    cache = torch.zeros(514, PS * 132, dtype=torch.uint8)
    kernel, grid, args, kwargs = triton_indexer_coop.score_select_launch(
        q, w, cache, table, req, pos, out, TOPK, PS, fused_select_chunk(1, 513 * PS))
    plain = kernel.warmup(*args, grid=grid, **kwargs)
    stamped = kernel.warmup(*args, grid=grid, **{**kwargs, "STAMPS": True})
    assert "globaltimer" not in plain.asm["ptx"] and "clock64" not in plain.asm["ptx"]
    assert stamped.asm["ptx"].count("%globaltimer") >= 8 and stamped.asm["ptx"].count("%clock64") >= 8


def test_the_polled_selection_compiles_without_a_read_modify_write_on_the_rows_state(monkeypatch, tmp_path):
    """The fused score + select with its rounds' histograms and its counts polled (`HIST_POLL`, `COUNT_POLL`, the
    engine's) arrives at no barrier and counts no program out: its sm_90 PTX holds no global `atom` (only the
    histograms' fire-and-forget `red` adds); each barrier that either switch puts back adds its arrival RMW. Its
    scores stay in registers (`KEYS_FIRST`), or go through the score buffer (compiled both ways here)."""
    import re

    offline_jit(monkeypatch, tmp_path / "triton", (triton_indexer_coop._coop_score_select_kernel,))
    _, table, req, pos, out = _operands(512, 1)  # 32K keys: decode's 256-key chunks
    q, w = torch.zeros(1, 32, 128, dtype=torch.bfloat16), torch.zeros(1, 32)
    cache = torch.zeros(513, PS * 132, dtype=torch.uint8)
    kernel, grid, args, kwargs = triton_indexer_coop.score_select_launch(
        q, w, cache, table, req, pos, out, TOPK, PS, fused_select_chunk(1, 512 * PS))
    assert kwargs["CHUNK"] == 256
    atoms = {}
    for poll, count_poll in ((True, True), (True, False), (False, True), (False, False)):
        ptx = kernel.warmup(*args, grid=grid, **{**kwargs, "POLL": poll, "COUNT_POLL": count_poll,
                                                 "KEYS_FIRST": count_poll}).asm["ptx"]
        atoms[poll, count_poll] = len(re.findall(r"\batom\.global\.", ptx))
        assert re.search(r"\bred\.global\.[\w.]*add", ptx)  # the histograms' adds, in every variant
    assert kwargs["POLL"] and kwargs["COUNT_POLL"] and kwargs["KEYS_FIRST"]  # the engine's launch
    assert atoms[True, True] == 0
    assert 0 < atoms[True, False] < atoms[False, False] and 0 < atoms[False, True] < atoms[False, False]
    # the scores made in registers reach the rounds' histograms in a blocked layout, not the MMA's row slice (each key
    # held by 4 threads: `triton_indexer_paged.chunk_scores`' gather)
    ttgir = kernel.warmup(*args, grid=grid, **kwargs).asm["ttgir"]
    histograms = [line for line in ttgir.splitlines() if "tt.histogram" in line]
    assert histograms and not any("#mma" in line for line in histograms)
