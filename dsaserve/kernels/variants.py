"""Where the attention core's GPU kernels change compiled variant (pure Python: no torch, no Triton).

Owns: the thresholds `kernels/triton_indexer.py` chooses its selection path and block size by, and the
classes of (rows, page-table width) the eager attention core can launch, so that the engine's warmup
(`engine/warmup_plan.py`) runs each class once before Up and a step never compiles a kernel after it
(note 000: "warmup 覆盖哪些形状"). Triton compiles one variant per set of constexprs and per integer
argument that is 1 or a multiple of 16; the core's page-table width is padded to `CORE_WIDTH_ALIGN` pages,
so every width-derived argument is a multiple of 16 and only the classes below remain. An eager prefill's page
table is not padded (as wide as its longest request): the selection kernels take its stride, and the radix
select its chunk count, unspecialised (tests/kernels/test_select_variants.py), so its classes are the same:
- indexer selection (`indexer_topk`): `take_all` (no scores) while the keys fit top-k (it does specialise the
  page-table stride: 1, a multiple of 16 or neither, three variants the start-up's warmup met on the H200, all in
  the recorded spec list); else the Triton
  selection for up to SELECT_MAX_ROWS rows with its block = the keys rounded up to a power of two (in registers
  up to ROW_IN_REGS_MAX keys, split into `long_select_chunk` chunks beyond: their size and the score tile change
  at 2 rows; 1-2 rows over the FP8 cache score and select in one launch in `fused_select_chunk` chunks up to
  FUSED_MAX_CHUNK keys); above, the prefill kernel (`triton_indexer_gemm`: its token arguments are not specialised, its
  workspace width is a multiple of 128; the fallback `triton_indexer_prefill` takes the token count as an
  integer argument: Triton compiles a variant for a count divisible by 16 and one for the rest, and the H200
  bench at 8K prompts compiled after Up until both were warmed).
- sparse MLA: the kernel (generic at 1 row, grouped from 2) and its flash-decoding splits, a function of
  rows x head blocks against the SM count: constant (1 split) past 2 x SMs rows; every row count up to
  ROW_SWEEP is warmed, which covers any GPU of up to ROW_SWEEP / 2 SMs.
"""

from __future__ import annotations

SELECT_MAX_ROWS = 512  # rows (tokens) up to which the Triton selection replaces torch.topk (decode-size)
ROW_IN_REGS_MAX = 16384  # keys per row up to which the selection holds the row in registers
CORE_WIDTH_ALIGN = 16  # pages: the eager core's page tables are padded to a multiple (padding names the sink page)
ROW_SWEEP = 512  # the sparse MLA split count varies with rows up to 2 x SMs (H200: 132 SMs)
SELECT_CHUNK = 4096  # keys a program of the split radix select takes (16 a thread at 8 warps)
FEW_ROWS = 2  # decode rows up to which long rows take their own score tile, select chunk and warp count
# programs the fused score + select launch of a few long rows aims at (`fused_select_chunk`): one an SM of the
# H200's 132 (a launch past the GPU's SM count falls back to scores + select: `triton_indexer_coop.coop_fits`)
FUSED_PROGRAMS = 128
# the largest fused chunk taken (4 score tiles a program). H200, graph-timed, keys from HBM (bench/RESULTS.md,
# twenty-second session): 1 x 32K keys 17.1 us fused (256-key chunks) against 21.0 for the two launches, 2 x 32K 23.0
# (512) against 26.8; but 1 x 128K 33.2 (1024) against 32.3 and 2 x 128K 52.0 (2048) against 43.1: one program an
# SM keeps too few tiles in flight for its chunk's keys, where the score kernel runs four an SM
FUSED_MAX_CHUNK = 512


def core_width(pages: int) -> int:
    """The page-table width the attention core runs at for a batch `pages` wide."""
    return max(CORE_WIDTH_ALIGN, -(-pages // CORE_WIDTH_ALIGN) * CORE_WIDTH_ALIGN)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def long_select_chunk(rows: int, keys: int) -> int:
    """The split radix select's chunk (a constexpr) for `rows` decode rows of `keys` (the static bound): at 1-2
    rows rows x keys / 64 rounded down to a power of two in [1024, SELECT_CHUNK] (~64 programs in all from 32K
    keys on), else SELECT_CHUNK. H200, bench/sweep_decode_b1.py --indexer, us: one row of 32K keys 17.0 at 1024
    against 22.2 at 4096, of 128K 20.9 at 2048 against 22.3; two rows of 32K 20.0 at 1024 against 25.6, of
    128K 22.9 at 4096 (2048: 23.7) - each the sweep's fastest."""
    if rows > FEW_ROWS:
        return SELECT_CHUNK
    return max(1024, min(SELECT_CHUNK, 1 << max(0, (rows * keys // 64).bit_length() - 1)))


FUSED_MIN_CHUNK = 256  # two score tiles


def fused_select_chunk(rows: int, keys: int) -> int:
    """The fused score + select launch's chunk (a constexpr) for `rows` decode rows of `keys`: the smallest power of
    two from FUSED_MIN_CHUNK that keeps rows x chunks within FUSED_PROGRAMS, so the scores spread over as many SMs
    as the cooperative launch may hold."""
    chunk = FUSED_MIN_CHUNK
    while rows * -(-keys // chunk) > FUSED_PROGRAMS and chunk < SELECT_CHUNK:
        chunk *= 2
    return chunk


def fused_select_widths() -> list[int]:
    """The static row bounds (keys) at which one decode row's fused score + select still runs FUSED_PROGRAMS programs
    at each of its chunks (FUSED_MIN_CHUNK .. FUSED_MAX_CHUNK): 32K and 64K keys. A row selected at a wider bound
    takes a larger chunk over fewer programs, past 64K the score kernel and the select's launch apart
    (`engine/decode_graphs.few_row_widths` captures decode graphs of 1-2 rows at these bounds)."""
    out, chunk = [], FUSED_MIN_CHUNK
    while chunk <= FUSED_MAX_CHUNK:
        out.append(FUSED_PROGRAMS * chunk)
        chunk *= 2
    return out


def selection_class(rows: int, pages: int, page_size: int, topk: int) -> tuple:
    """The indexer selection's compiled variant for `rows` tokens over a batch `pages` wide."""
    keys = core_width(pages) * page_size
    if keys <= topk:
        return ("all_visible",)
    if rows > SELECT_MAX_ROWS:
        return ("prefill", rows % 16 == 0)
    if keys <= ROW_IN_REGS_MAX:
        return ("select_regs", _pow2(keys))
    # the fused chunk only where decode takes it (the FP8 cache; the plain layouts and GPUs with fewer SMs than
    # FUSED_PROGRAMS take scores + select at the long chunk, also in the class)
    few = rows <= FEW_ROWS
    fused = fused_select_chunk(rows, keys) if few else 0
    return ("select_chunks", few, long_select_chunk(rows, keys), fused if fused <= FUSED_MAX_CHUNK else 0)


def attention_row_class(rows: int) -> int:
    """Sparse MLA's compiled variant depends on rows only below ROW_SWEEP (kernel choice and splits)."""
    return min(rows, ROW_SWEEP + 1)


def width_representatives(max_pages: int, page_size: int, topk: int) -> list[int]:
    """One page-table width (pages) per selection block class a batch up to `max_pages` wide can reach."""
    seen: dict[tuple, int] = {}
    for pages in range(CORE_WIDTH_ALIGN, core_width(max_pages) + 1, CORE_WIDTH_ALIGN):
        seen.setdefault(selection_class(1, pages, page_size, topk), pages)
    return sorted(seen.values())
