"""cuBLAS's block-scaled FP8 GEMM split along K over concurrent streams (decode batches of 33-256 rows).

At 64-128 rows cuBLAS (`torch._scaled_mm`) runs one 128 x 128 output tile a CTA over the whole of K: o_proj and the
dense down fill 48 of the H200's 132 SMs, qkv_a 22, and each tile runs at one SM's MMA rate, not at HBM's
(bench/RESULTS.md, twenty-eighth session: o_proj 48.5 us a layer for 100 MB, 2.1 TB/s; padding the rows to 256-512
gave more tiles of the same length and no gain). `_scaled_mm` does not reach cuBLAS's own split-K, and the Triton /
Gluon split-K GEMMs ran at 0.37 of cuBLAS's per-SM rate (thirty-first session). So here the K range is cut in S
parts, S `_scaled_mm` calls run at once on S streams (branches of the CUDA graph under capture), each writing its
bf16 partial, and one sum adds them (in fp32, one bf16 rounding of each partial more than the unsplit call).

cuBLASLt reads a weight's block scales as a dense [K/128, N/128] block whatever the strides (`triton_fp8_gemm.
scaled_mm_ok`), so each part's weight scales are a contiguous copy; the weight, the activations and their scales
are read through views. `prepare` makes the copies and the streams on a weight's first eager call, split or not
(a warm start runs only its largest bucket eagerly, whose rows may split nothing), and calls cuBLAS once on each
stream so its workspace there is not first allocated inside a capture; a capture that still finds them unmade
runs the GEMM whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from dsaserve.kernels.triton_utils import TensorNote, made_once

# Off until timed: written after the thirty-eighth session's device time ran out (the machine was not lent again);
# `.devcalls`' next call runs its GPU test, `probe_scaled_mm_rows.py --split-streams` and the step's A/B
# (bench/profile_decode.py's "cublas_split" setting turns it on)
ENABLED = False
MAX_SPLITS = 4
MAX_ROWS = 256
# cuBLASLt pads the weight scales' K blocks to a multiple of 4 (`scaled_mm_shape_ok`): each part is whole 512s of K
K_GRAIN = 512
_PART_SCALES = TensorNote("_dsaserve_split_k_scales")
_STREAMS: dict[int | None, list[torch.cuda.Stream]] = {}


def split_count(m_pad: int, n: int, k: int, sms: int) -> int:
    """Parts to cut K in: as many as keep the output tiles x parts within one wave of the SMs (at most MAX_SPLITS),
    each part whole K_GRAIN columns; 1 where the unsplit call already fills half the SMs or the rows are past
    MAX_ROWS (a prefill: enough tiles)."""
    tiles = -(-m_pad // 128) * -(-n // 128)
    if not ENABLED or m_pad > MAX_ROWS or 2 * tiles > sms:
        return 1
    for s in range(min(MAX_SPLITS, sms // tiles), 1, -1):
        if k % (s * K_GRAIN) == 0:
            return s
    return 1


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def prepare(scale: torch.Tensor) -> None:
    """A weight's part scales and its device's streams, on an eager call (cheap once made; nothing while off)."""
    if ENABLED and not _capturing(scale):
        part_scales(scale, 2)
        if scale.is_cuda:
            _streams(scale.device)


def part_scales(scale: torch.Tensor, splits: int) -> tuple[torch.Tensor, ...] | None:
    """The weight's [N/128, K/128] scales cut in `splits` contiguous [N/128, K/128/splits] parts (every valid part
    count made at once on the first call, outside a capture); None inside a capture that finds none."""
    made = _PART_SCALES.get(scale)
    if made is None:
        if _capturing(scale):
            return None
        kb = scale.shape[1]
        made = ({s: tuple(p.contiguous() for p in scale.chunk(s, dim=1))
                 for s in range(2, MAX_SPLITS + 1) if (kb * 128) % (s * K_GRAIN) == 0},)
        _PART_SCALES.attach(scale, made)
    return made[0].get(splits)


def _streams(device: torch.device) -> list[torch.cuda.Stream] | None:
    """MAX_SPLITS - 1 streams of the device for the parts after the first, each with cuBLAS called once on it (made
    outside any capture; None inside one that finds them unmade)."""
    if device.index not in _STREAMS and torch.cuda.is_current_stream_capturing():
        return None
    return made_once(_STREAMS, device.index, device, "cublas_split_k streams", lambda: _made_streams(device))


def _made_streams(device: torch.device) -> list[torch.cuda.Stream]:
    streams = [torch.cuda.Stream(device) for _ in range(MAX_SPLITS - 1)]
    a = torch.zeros(16, K_GRAIN, device=device).to(torch.float8_e4m3fn)
    w = torch.zeros(128, K_GRAIN, device=device).to(torch.float8_e4m3fn)
    a_s, w_s = torch.ones(K_GRAIN // 128, 16, device=device).t(), torch.ones(1, K_GRAIN // 128, device=device)
    here = torch.cuda.current_stream(device)
    for side in streams:  # cuBLAS's workspace for each stream, made here rather than in a graph's pool
        side.wait_stream(here)
        with torch.cuda.stream(side):
            torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=w_s.t(), out_dtype=torch.bfloat16)
        here.wait_stream(side)
    return streams


def split_scaled_mm(a: torch.Tensor, a_s: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, splits: int,
                    mm: Callable = torch._scaled_mm,
                    streams: list[torch.cuda.Stream] | None = None) -> torch.Tensor | None:
    """a [M, K] e4m3 with outer-dim-major 1x128 scales a_s [M, K/128] times the weight [N, K] (128x128 scales
    [N/128, K/128]) -> [M, N] bf16, K cut in `splits` parts run at once; None where a capture finds the parts'
    scales or streams unmade (the caller runs it whole). `mm` and `streams` are for the CPU test (a dequantising
    matmul, no streams)."""
    scales = part_scales(scale, splits)
    if streams is None and a.is_cuda:
        streams = _streams(a.device)
    if scales is None or (a.is_cuda and streams is None):
        return None
    ks = a.shape[1] // splits
    parts = torch.empty(splits, a.shape[0], weight.shape[0], dtype=torch.bfloat16, device=a.device)
    here = torch.cuda.current_stream(a.device) if a.is_cuda else None
    for s in range(splits):
        cols, blocks = slice(s * ks, (s + 1) * ks), slice(s * ks // 128, (s + 1) * ks // 128)
        side = streams[s - 1] if here is not None and s else None
        if side is not None:
            side.wait_stream(here)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            mm(a[:, cols], weight[:, cols].t(), scale_a=a_s[:, blocks], scale_b=scales[s].t(), out_dtype=torch.bfloat16,
               out=parts[s])
    for side in streams[: splits - 1] if here is not None else ():
        here.wait_stream(side)  # `parts` and the inputs live on past the join: no record_stream needed
    return parts.sum(0)
