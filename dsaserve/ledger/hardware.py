"""Hardware presets for the ledger: HBM size and bandwidth, dense FLOP/s, NVLink / IB bandwidth and the
per-collective overhead, each value with its source.

Owns: the `Hardware` dataclass and the `h200`, `h100`, `h20`, `b200` presets, overridable field by field
(`--hbm-gb`, `--nvlink-gbs`, ...). Every FLOP/s figure is **dense** (the datasheets' headline numbers are
2:4-sparse, twice these); every link bandwidth is **per GPU per direction** (datasheets quote NVLink
bidirectional: 900 GB/s on Hopper = 450 GB/s each way). Planning tool, no stage of the request path.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from dsaserve.ledger.units import GB, TFLOPS, US, MiB

_NVLINK_OVERHEAD = "note 001: 'NVLink 上每次约 3–5µs' (kernel launch + sync + protocol); upper end taken"
# The H200's NVLink per-collective latency: what one small collective costs when it replays inside a CUDA graph
# (no host launch), the way dsaserve's decode steps run them. Measured, not note 001's 3-5 us: glm-5.3-slice
# at TP2 batch 1 on two H200s (bench/RESULTS.md, sixth session, one-shot symmetric-memory all-reduces) spent
# 0.103 ms on its step's 14 collectives where the ledger's 14 x latency + bytes / bandwidth gave 0.071 ms at
# 5 us: (0.103 - 0.071) / 14 + 5 us = 7.3 us. Checked on runs the fit did not use: TP2 batch 8 (0.133 ms
# measured, 0.110 ledger: -17 %) and TP2+EP2 batch 1 over NCCL (0.145 measured, 0.125 ledger: -14 %).
# NCCL's own small all-reduce is slower (~10.6 us by the same arithmetic, 0.148 ms at TP2): dsaserve sends
# decode-size all-reduces through symmetric memory. bench/bench_multi_gpu.py's in-graph latency sweep
# (`fit_latency`) prints a fresh value per run.
H200_NVLINK_LATENCY_S = 7.3 * US
H200_NVLINK_LATENCY_SOURCE = ("measured: glm-5.3-slice TP2 batch-1 decode on 2xH200, 14 collectives in 0.103 ms "
                              "(bench/RESULTS.md, sixth session; bench/bench_multi_gpu.py's latency sweep "
                              "re-measures it); note 001 assumed 3-5 us")
_IB_OVERHEAD = "assumption: inter-node NCCL small-message latency is several times NVLink's; measure on your fabric"
_IB_CX7 = "ConnectX-7 400 Gb/s NDR, one NIC per GPU in the HGX reference design = 50 GB/s each way"


def checked_value(name: str, v: Any, label: str | None = None) -> float:
    """A hardware figure: finite and positive, or >= 0 for a collective's overhead (a free collective is a
    legitimate what-if). The ValueError names `label` (the flag as the user typed it) or the field."""
    zero_ok = name.endswith("overhead_s")
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0 \
            or (v == 0 and not zero_ok):
        shown = f"{v:g}" if isinstance(v, int | float) and not isinstance(v, bool) else repr(v)
        need = "a number >= 0" if zero_ok else "a positive number"
        raise ValueError(f"{label or f'hardware {name}'}: must be {need}, got {shown}")
    return float(v)


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes: float  # total device memory the allocator sees (what mem_fraction_static multiplies)
    hbm_bw: float  # B/s, datasheet peak
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float  # dense FLOP/s
    nvlink_bw: float  # B/s per GPU per direction
    ib_bw: float  # B/s per GPU per direction
    nvlink_overhead_s: float  # fixed cost of one collective inside the node
    ib_overhead_s: float  # fixed cost of one collective across nodes
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def with_overrides(self, **values: float | None) -> Hardware:
        """A copy with the given fields replaced (None = keep); each override is recorded as its source."""
        known = {f.name for f in fields(self)} - {"name", "sources"}
        changed: dict[str, Any] = {}
        for k, v in values.items():
            if k not in known:
                raise ValueError(f"hardware field {k!r}: unknown (one of {', '.join(sorted(known))})")
            if v is None:
                continue
            changed[k] = checked_value(k, v)
        if not changed:
            return self
        sources = dict(self.sources)
        sources.update({k: "command-line override" for k in changed})
        return replace(self, name=f"{self.name}*", sources=sources, **changed)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, Hardware] = {
    "h200": Hardware(
        "h200", hbm_bytes=150_109_880_320, hbm_bw=4.8e12, bf16_flops=989 * TFLOPS, fp8_flops=1979 * TFLOPS,
        nvlink_bw=450 * GB, ib_bw=50 * GB, nvlink_overhead_s=H200_NVLINK_LATENCY_S, ib_overhead_s=15 * US,
        sources={
            "hbm_bytes": "measured: torch.cuda.mem_get_info() total on an H200 SXM (nvidia-smi 143,771 MiB; "
                         "datasheet '141 GB')",
            "hbm_bw": "NVIDIA H200 datasheet: 4.8 TB/s HBM3e",
            "bf16_flops": "H200 SXM datasheet 1,979 TFLOPS BF16 with sparsity -> 989 dense",
            "fp8_flops": "H200 SXM datasheet 3,958 TFLOPS FP8 with sparsity -> 1,979 dense",
            "nvlink_bw": "datasheet NVLink 900 GB/s (bidirectional, 18 NVLink4 links) -> 450 GB/s each way",
            "ib_bw": _IB_CX7, "nvlink_overhead_s": H200_NVLINK_LATENCY_SOURCE, "ib_overhead_s": _IB_OVERHEAD}),
    "h100": Hardware(
        "h100", hbm_bytes=81_559 * MiB, hbm_bw=3.35e12, bf16_flops=989 * TFLOPS, fp8_flops=1979 * TFLOPS,
        nvlink_bw=450 * GB, ib_bw=50 * GB, nvlink_overhead_s=5 * US, ib_overhead_s=15 * US,
        sources={
            "hbm_bytes": "nvidia-smi memory.total of H100 SXM5 80GB (81,559 MiB) as commonly reported; "
                         "not measured here",
            "hbm_bw": "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3",
            "bf16_flops": "H100 SXM datasheet 1,979 TFLOPS BF16 with sparsity -> 989 dense",
            "fp8_flops": "H100 SXM datasheet 3,958 TFLOPS FP8 with sparsity -> 1,979 dense",
            "nvlink_bw": "datasheet NVLink 900 GB/s bidirectional -> 450 GB/s each way",
            "ib_bw": _IB_CX7, "nvlink_overhead_s": _NVLINK_OVERHEAD, "ib_overhead_s": _IB_OVERHEAD}),
    "h20": Hardware(
        "h20", hbm_bytes=97_871 * MiB, hbm_bw=4.0e12, bf16_flops=148 * TFLOPS, fp8_flops=296 * TFLOPS,
        nvlink_bw=450 * GB, ib_bw=50 * GB, nvlink_overhead_s=5 * US, ib_overhead_s=15 * US,
        sources={
            "hbm_bytes": "nvidia-smi memory.total of H20 96GB (97,871 MiB) as commonly reported; not measured here",
            "hbm_bw": "NVIDIA H20 spec sheet: 4.0 TB/s HBM3",
            "bf16_flops": "H20 spec sheet: 148 TFLOPS BF16 dense",
            "fp8_flops": "H20 spec sheet: 296 TFLOPS FP8 dense",
            "nvlink_bw": "H20 spec sheet NVLink 900 GB/s bidirectional -> 450 GB/s each way",
            "ib_bw": _IB_CX7, "nvlink_overhead_s": _NVLINK_OVERHEAD, "ib_overhead_s": _IB_OVERHEAD}),
    "b200": Hardware(
        "b200", hbm_bytes=183_359 * MiB, hbm_bw=8.0e12, bf16_flops=2250 * TFLOPS, fp8_flops=4500 * TFLOPS,
        nvlink_bw=900 * GB, ib_bw=50 * GB, nvlink_overhead_s=5 * US, ib_overhead_s=15 * US,
        sources={
            "hbm_bytes": "nvidia-smi memory.total of HGX B200 180GB (183,359 MiB) as commonly reported; "
                         "not measured here",
            "hbm_bw": "HGX B200 datasheet: 8 TB/s HBM3e per GPU (64 TB/s per 8-GPU board)",
            "bf16_flops": "HGX B200 datasheet 4.5 PFLOPS FP16/BF16 with sparsity -> 2.25 dense",
            "fp8_flops": "HGX B200 datasheet 9 PFLOPS FP8 with sparsity -> 4.5 dense",
            "nvlink_bw": "NVLink 5: 1.8 TB/s bidirectional per GPU -> 900 GB/s each way",
            "ib_bw": "DGX B200: 8x ConnectX-7 400 Gb/s = 50 GB/s per GPU each way",
            "nvlink_overhead_s": _NVLINK_OVERHEAD + " (Hopper figure, reused)", "ib_overhead_s": _IB_OVERHEAD}),
}


def get_hardware(name: str) -> Hardware:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"--hardware: {name!r} is not a preset ({', '.join(PRESETS)})") from None


def fit_latency(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bytes/s) of `seconds = latency + wire_bytes / bandwidth`, least squares over measured
    (wire_bytes, seconds) points — how bench/bench_multi_gpu.py turns its in-graph sweep of small collectives
    into this module's per-collective latency. A flat or falling sweep (latency-bound everywhere) gives an
    infinite bandwidth and the mean time as the latency; the latency is never negative."""
    if not points:
        raise ValueError("fit_latency: no (wire_bytes, seconds) points")
    n = len(points)
    mx, my = sum(b for b, _ in points) / n, sum(t for _, t in points) / n
    var = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (t - my) for b, t in points) / var if var else 0.0
    if slope <= 0:
        return max(my, 0.0), float("inf")
    return max(my - slope * mx, 0.0), 1.0 / slope
