"""Which cuBLASLt algorithm each decode-size FP8 projection and the few-row lm_head run: chosen by timing once a
shape and row class at start-up (issue 17).

Owns: the choices (`tune`), the two call sites' way to them (`linear` for `scaled_mm_linear`,
`lm_head` for `LMHead.forward`), and what the benches share: the graph timer (`graph_us`, `replay_seconds`) and
the weight copies past the L2 (`fp8_weight_copies`).

`_scaled_mm` runs the heuristic's first algorithm; at 33-512 rows that is often one 128 x 128 tile a CTA over the
whole K, which leaves most SMs idle on the narrow projections (bench/RESULTS.md, forty-second session). Before the
graphs are captured (`engine/gemm_tuning.py`), each FP8 projection shape the cuBLAS path takes is timed at the top
of each row class (ROW_CLASSES) as a CUDA graph over weight copies past the L2: `_scaled_mm`, then the heuristic's first
CANDIDATES algorithms (`cublaslt.Gemm`), each checked against `_scaled_mm`'s output first. A candidate at least
MIN_GAIN faster is that (shape, class)'s choice; `linear` then runs it for every row count of the class that the
algorithm supports (`Gemm.supports`) inside a CUDA graph's capture (an eager call's ctypes host time would cost
more than it saves), and `_scaled_mm` runs everything else. Choices are per process: a restart
times again (the same kernels mostly win; where two are within the noise a restart may take the other, whose sums
differ by bf16 rounding).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Iterable

import torch

from dsaserve.common import envs
from dsaserve.kernels import cublaslt

# on unless DSASERVE_GEMM_TUNING=0 (every projection on torch's own choice; profile_decode --ab lt_off / lt_tuned)
TUNED = envs.DSASERVE_GEMM_TUNING
ROW_CLASSES = (64, 128, 256, 512)  # a projection of m rows (33..512) takes the choice timed at the class's top
CANDIDATES = 12
# a kernel's timing repeats within ~1 %; the lm_head's other tiles gain 2.4-3.3 % at 1-32 rows, and 12-22 us in
# the batch-1 step overlapped (H100, bench/RESULTS.md, forty-eighth session)
MIN_GAIN = 1.02
L2_PAST_BYTES = 160 << 20  # weight copies over this much: each timed call reads its weight from HBM

TIMED: set[int] = set()  # devices `tune` has run on
_CHOICES: dict[tuple, cublaslt.Algo] = {}  # (device, class, n, k) or (device, m, n, k, "bf16") -> algorithm
_GEMMS: dict[tuple, cublaslt.Gemm | None] = {}  # (device, m, n, k[, "bf16"]) -> None: the algorithm cannot run it


def row_class(m: int) -> int | None:
    """The smallest class holding m rows, None past the last."""
    return next((c for c in ROW_CLASSES if m <= c), None)


def _gemm_for(key: tuple, m: int, n: int, k: int, algo: cublaslt.Algo, scales: tuple = (None, None)
              ) -> cublaslt.Gemm | None:
    """The shape's descriptors, made once; None where the algorithm (timed at another row count) cannot run it."""
    if key not in _GEMMS:
        gemm = cublaslt.Gemm(m, n, k, fp8=len(key) == 4)
        _GEMMS[key] = gemm if gemm.supports(algo, *scales) else None
    return _GEMMS[key]


def _aligned(*tensors: torch.Tensor) -> bool:
    """cuBLASLt's heuristic assumes 256-byte aligned operands (its MIN_ALIGNMENT preferences' default)."""
    return all(t.data_ptr() % 256 == 0 for t in tensors)


def _usable(t: torch.Tensor) -> bool:
    return TUNED and t.device.index in TIMED and torch.cuda.is_current_stream_capturing()


def linear(a: torch.Tensor, a_s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """y [M, N] bf16 = a @ dequant(weight)^T by the tuned algorithm of a's shape and row class, or None (the
    caller runs `_scaled_mm`). a: e4m3 [M, K], M a multiple of 16; a_s its outer-dim-major 1 x 128 scales."""
    if not _usable(a):
        return None
    m, k = a.shape
    n, cls = weight.shape[0], row_class(m)
    algo = _CHOICES.get((a.device.index, cls, n, k)) if cls is not None else None
    if algo is None or not _aligned(a, a_s, weight, scale):
        return None
    gemm = _gemm_for((a.device.index, m, n, k), m, n, k, algo, (a_s, scale))
    if gemm is None:
        return None
    return gemm.run(algo, a, weight, torch.empty(m, n, dtype=torch.bfloat16, device=a.device), a_s, scale)


def graph_us(calls: list[Callable[[], object]], reps: int = 7) -> float:
    """Median µs a call of a CUDA graph running `calls` in order (warmed on a side stream first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    return statistics.median(replay_seconds(graph, reps)) * 1e6 / len(calls)


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int) -> list[float]:
    """Seconds of each of `reps` replays, one at a time: an event before the replay to one after it."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def fp8_weight_copies(n: int, k: int, device: torch.device | str, past_bytes: int = L2_PAST_BYTES
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random copies of an [N, K] e4m3 weight and its 128 x 128 block scales, over past_bytes in all: replays that
    take each in turn read HBM, not the L2 (the timing here and the benches' probes)."""
    copies = max(2, -(-past_bytes // (n * k)))
    return [((torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.5).to(torch.float8_e4m3fn),
             torch.rand(n // 128, k // 128, device=device) * 1e-2 + 1e-3) for _ in range(copies)]


def _pick(torch_calls: list[Callable[[], object]], want: torch.Tensor, candidates: list[cublaslt.Candidate],
          output_of: Callable[[cublaslt.Candidate], torch.Tensor],
          calls_of: Callable[[cublaslt.Candidate], list[Callable[[], object]]], head: dict) -> dict:
    """torch's calls and each candidate's (its output checked against `want` first), graph-timed; torch's timed
    before and after the candidates and its faster reading kept (a shape's first timing may run on clocks still
    rising: a choice must beat torch at its best). The row of the report, with the chosen algorithm."""
    torch_us, best = graph_us(torch_calls), (float("inf"), None)
    for cand in candidates:
        if float((output_of(cand).float() - want.float()).norm() / want.float().norm()) > 1e-2:
            continue  # not the same product (never seen; a guard, not a choice)
        best = min(best, (graph_us(calls_of(cand)), cand), key=lambda b: b[0])
    torch_us = min(torch_us, graph_us(torch_calls))
    chosen = best[1] if best[1] is not None and torch_us / best[0] >= MIN_GAIN else None
    return {**head, "torch_us": round(torch_us, 2), "best_us": round(best[0], 2) if best[1] is not None else None,
            "chosen": chosen.config() if chosen else None, "algo": chosen.algo if chosen else None}


def time_shape(n: int, k: int, m: int, device: torch.device) -> dict:
    """`_scaled_mm` and each candidate at (m, n, k) over weight copies past the L2 (`_pick`)."""
    ws = fp8_weight_copies(n, k, device)
    # e4m3 rows and positive outer-dim-major 1 x 128 scales, as `quant_act_fp8(pad_m_to=16, scale_m_major=True)`
    a = (torch.randn(m, k, device=device, dtype=torch.bfloat16) * 64).to(torch.float8_e4m3fn)
    a_s = (torch.rand(k // 128, m, device=device) * 1e-2 + 1e-3).t()
    want = torch._scaled_mm(a, ws[0][0].t(), scale_a=a_s, scale_b=ws[0][1].t(), out_dtype=torch.bfloat16)
    gemm, y = cublaslt.Gemm(m, n, k, fp8=True), torch.empty_like(want)
    return _pick([lambda w=w, s=s: torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=s.t(), out_dtype=torch.bfloat16)
                  for w, s in ws], want, gemm.algos(CANDIDATES, a_s, ws[0][1]),
                 lambda c: gemm.run(c.algo, a, ws[0][0], y, a_s, ws[0][1]),
                 lambda c: [lambda w=w, s=s: gemm.run(c.algo, a, w, y, a_s, s) for w, s in ws],
                 {"n": n, "k": k, "m": m})


def lm_head(h: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """out [M, V] = h @ weight^T (bf16) by the algorithm timed fastest at exactly M rows, or None (the caller runs
    torch.mm)."""
    if not _usable(h) or h.dim() != 2:
        return None
    m, k = h.shape
    key = (h.device.index, m, weight.shape[0], k, "bf16")
    algo = _CHOICES.get(key)
    if algo is None or tuple(out.shape) != (m, weight.shape[0]) or \
            any(t.dtype != torch.bfloat16 or not t.is_contiguous() for t in (h, weight, out)) or \
            not _aligned(h, weight, out):
        return None
    gemm = _gemm_for(key, m, weight.shape[0], k, algo)
    return gemm.run(algo, h, weight, out) if gemm is not None else None


def time_lm_head(weight: torch.Tensor, m: int) -> dict:
    """torch.mm and each candidate at m rows over the model's own lm_head weight (past the L2 whatever its size
    at GLM-5.3's vocabulary: 1.9 GB; `_pick`)."""
    n, k = weight.shape
    h = torch.randn(m, k, device=weight.device, dtype=weight.dtype)
    want, y = h @ weight.t(), torch.empty(m, n, device=weight.device, dtype=weight.dtype)
    gemm = cublaslt.Gemm(m, n, k, fp8=False)
    return _pick([lambda: torch.mm(h, weight.t(), out=y)], want, gemm.algos(CANDIDATES),
                 lambda c: gemm.run(c.algo, h, weight, y), lambda c: [lambda: gemm.run(c.algo, h, weight, y)],
                 {"n": n, "k": k, "m": m, "dtype": "bf16"})


LM_HEAD_ROWS = (1, 2, 4, 8, 16, 32)  # decode buckets whose logits GEMM is timed (the batch-1 step's largest kernel)


def _forget(index: int) -> None:
    """A device's earlier choices and descriptors (another runner in this process): a new timing may choose
    otherwise, or torch, and a descriptor's `supports` answered for the algorithm it was made with. Graphs already
    captured keep what they captured (descriptors are never destroyed)."""
    TIMED.discard(index)
    for table in (_CHOICES, _GEMMS):
        for key in [k for k in table if k[0] == index]:
            del table[key]


def tune(shapes: Iterable[tuple[int, int]], max_rows: int, device: torch.device,
         lm_head_weight: torch.Tensor | None = None, min_rows: int = 33) -> dict:
    """Time every FP8 shape (N, K: cuBLAS's block scaling takes them) at each class from min_rows (the skinny
    kernels' end + 1) up to max_rows' and the bf16 lm_head at LM_HEAD_ROWS up to max_rows, and keep the winners;
    the manifest's report."""
    t0, rows = time.perf_counter(), []
    index = device.index if device.index is not None else torch.cuda.current_device()
    _forget(index)
    classes = [c for c in ROW_CLASSES if c >= min_rows and (row_class(max_rows) or ROW_CLASSES[-1]) >= c]
    # (key, timing) of each case: the FP8 ones only where cuBLAS's block scaling runs (`scaled_mm_ok`: Hopper)
    hopper = bool(shapes) and torch.cuda.get_device_capability(device) == (9, 0)
    cases = [((index, cls, n, k), functools.partial(time_shape, n, k, cls, device))
             for n, k in shapes for cls in classes if hopper]
    if lm_head_weight is not None and lm_head_weight.dtype == torch.bfloat16:
        cases += [((index, m, *lm_head_weight.shape, "bf16"), functools.partial(time_lm_head, lm_head_weight, m))
                  for m in LM_HEAD_ROWS if m <= max_rows]
    with torch.cuda.device(index):
        try:
            cublaslt.handle(index)
            for side in (False, True):  # before any capture (`cublaslt.workspace`)
                cublaslt.workspace(index, side)
        except (cublaslt.CublasLtError, OSError) as e:  # no cuBLASLt to call here: torch's choices stay
            return {"seconds": round(time.perf_counter() - t0, 2), "chosen": 0, "error": str(e)[:200]}
        try:
            for key, timing in cases:
                try:
                    row = timing()
                except (cublaslt.CublasLtError, RuntimeError) as e:  # this case stays on torch's own choice
                    rows.append({"case": list(key[1:]), "error": f"{type(e).__name__}: {str(e)[:200]}"})
                    continue
                algo = row.pop("algo")
                if algo is not None:
                    _CHOICES[key] = algo
                rows.append(row)
        finally:
            torch.cuda.empty_cache()  # the timing's weight copies are not the memory profile's
    TIMED.add(index)
    return {"seconds": round(time.perf_counter() - t0, 2),
            "chosen": sum(r.get("chosen") is not None for r in rows), "shapes": rows}

