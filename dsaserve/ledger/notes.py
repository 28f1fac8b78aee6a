"""The notes' figures as checks: every number of seeds/000 and seeds/001 next to the ledger's value.

Owns: the `Figure` record (note, place, quantity, the note's text and value, the ledger's value under the
note's own stated inputs, the agreement band, and the reason when they differ), the inputs the notes
state (H200 at 141 GB / 4.8 TB/s, NVLink "ring effective" 787 GB/s, IB 25 GB/s, 0.85 static share,
TP8 layer-split KV, every expert touched, dispatch / combine over all b tokens) that the catalogues
(`notes_000.py`, `notes_001.py`, `notes_001_worked.py`) import; `note_catalogue.py` evaluates them. The
ledger's own defaults differ in places; a figure then also carries `default` (the ledger's value under its
defaults) and why. Where the note contradicts its own numbers a figure carries `note_own` and differs.
Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from dsaserve.config import ModelConfig, load_config
from dsaserve.ledger.deployment import Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import PRESETS, Hardware
from dsaserve.ledger.kv import KVPerToken, kv_per_token
from dsaserve.ledger.units import GB, TFLOPS
from dsaserve.ledger.weights import WeightInventory, inventory

UNITS = {"": 1.0, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "us": 1e-6, "ms": 1e-3, "s": 1.0,
         "PFLOP": 1e15, "PFLOP/s": 1e15, "K": 1e3, "M": 1e6, "%": 0.01, "x": 1.0, "tokens": 1.0, "pages": 1.0,
         "calls": 1.0, "params": 1.0, "B params": 1e9, "steps/s": 1.0, "requests": 1.0, "launches": 1.0}


def _half_ulp(text: str) -> float:
    """Half a unit in the last written digit: '494' -> 0.5, '0.63' -> 0.005, '2.83' -> 0.005."""
    digits = text.split(".")[1] if "." in text else ""
    return 0.5 * 10 ** (-len(digits))


@dataclass(frozen=True)
class Figure:
    id: str
    note: str  # "000" or "001"
    where: str  # the note's section
    quantity: str
    note_text: str  # the number as the note writes it, e.g. "494", "20-30", "<15"
    unit: str  # display unit of note_text (a key of UNITS)
    ledger: float  # SI base units
    reason: str = ""  # why the ledger's value differs (empty when it agrees)
    tol: float | None = None  # agreement band in display units (default: half a unit in the last digit)
    default: float | None = None  # the ledger under its own defaults, where those differ from the note's inputs
    default_why: str = ""
    # the figure recomputed from the note's own other numbers (SI): outside the note's band, the note
    # contradicts itself, and the figure differs even where the ledger's value happens to fall in the band
    note_own: float | None = None

    @property
    def bounds(self) -> tuple[float, float]:
        """The note's value as an interval in SI units (a range 'a-b', an upper bound '<a', or one value)."""
        t, s = self.note_text.replace(",", ""), UNITS[self.unit]
        tol = _half_ulp(t.lstrip("<>~").split("-")[-1]) if self.tol is None else self.tol
        if t.startswith("<"):
            return (float("-inf"), float(t[1:]) * s)
        if "-" in t[1:]:
            lo, hi = t.split("-", 1)
            return ((float(lo) - tol) * s, (float(hi) + tol) * s)
        return ((float(t) - tol) * s, (float(t) + tol) * s)

    @property
    def note_value(self) -> float:
        lo, hi = self.bounds
        return hi if lo == float("-inf") else (lo + hi) / 2

    def _in_band(self, value: float) -> bool:
        lo, hi = self.bounds
        return lo <= value <= hi

    @property
    def consistent(self) -> bool:
        """The note's figure follows from the note's own numbers (True where that was not checked)."""
        return self.note_own is None or self._in_band(self.note_own)

    @property
    def agrees(self) -> bool:
        return self._in_band(self.ledger) and self.consistent

    @property
    def status(self) -> str:
        return "agrees" if self.agrees else "differs"

    def ledger_in_unit(self) -> float:
        return self.ledger / UNITS[self.unit]


# What the notes state as inputs (not errors): the ledger uses these to reproduce them.
NOTE_HW = Hardware(
    "notes", hbm_bytes=141 * GB, hbm_bw=4.8e12, bf16_flops=989 * TFLOPS, fp8_flops=1979 * TFLOPS,
    nvlink_bw=787.5 * GB, ib_bw=25 * GB, nvlink_overhead_s=0.0, ib_overhead_s=0.0,
    sources={"hbm_bytes": "note 000: '8 张 141GB 的卡'", "hbm_bw": "note 001: '每卡 4.8TB/s HBM'",
             "nvlink_bw": "note 001: 'ring 有效带宽约 787GB/s' (= 900 GB/s x 7/8)",
             "ib_bw": "note 001: 'IB(200Gb/s ≈ 25GB/s)'",
             "nvlink_overhead_s": "note 001's byte tables: '忽略协议开销'"})
# a2a_count="deployment": the notes' table counts dispatch / combine as b x 8 x 6144 over the whole
# deployment's b ("发送方视角"), not one rank's ceil(b/dp) tokens.
NOTE_ASM = Assumptions(comm_basis="message", expert_routing="all", moe_dense_tp_size=1, mla_kv="split",
                       indexer_q_tile=32, mem_fraction_static=0.85, a2a_count="deployment")
NOTE_TP8 = Deployment(tp=8)
NOTE_DP_EP8 = Deployment(tp=8, ep=8, dp_attention=True)


@dataclass
class NoteContext:
    """GLM-5.3 under the notes' inputs, shared by both catalogues."""

    cfg: ModelConfig = field(default_factory=lambda: load_config("glm-5.3"))
    hw: Hardware = NOTE_HW
    asm: Assumptions = NOTE_ASM
    work: Workload = field(default_factory=Workload)

    @cached_property
    def inv(self) -> WeightInventory:
        return inventory(self.cfg)

    def kv(self, layout: str = "fp8_ds_mla") -> KVPerToken:
        return kv_per_token(self.cfg, layout, self.asm)

    @property
    def h200(self) -> Hardware:
        return PRESETS["h200"]

