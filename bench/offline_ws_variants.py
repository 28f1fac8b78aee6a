"""Offline sm_90 compile of the warp-specialised sparse MLA kernel's A/B variants (`gluon_sparse_mla_ws.CANDIDATES`),
without a GPU: spills and main-loop instructions of each partition, which ptxas -v only gives for the kernel whole.

Run with the device's Triton (3.6):  PYTHONPATH=<triton 3.6 site-packages>:. python bench/offline_ws_variants.py
  [--only a,b] [--splits 4] [--sass DIR] [--fp8: the fp8_ds_mla kernel, gluon_sparse_mla_ws_fp8]
  [--dec: the decode-schedule fp8 kernel, gluon_sparse_mla_dec_fp8, its DEC_CANDIDATES; partitions by its DEC_REGS]
Each variant's launch comes from `gluon_sparse_mla.launch_plan` on CPU tensors (4096 tokens, top-2048), compiled for
GPUTarget("cuda", 90, 32) (bench/offline_compile.py); the SASS is cut into partitions at each USETMAXREG
(setmaxnreg): the two 216-register consumers (WG0, then WG1: warp_specialize's order) and the 72-register producer.
A partition's local bytes are the distinct spill slots its STL / LDL touch; its loop is its longest backward branch
(the round loop: the mbarrier retry loops sit out of line). --sass keeps each variant's SASS (to diff against the
default: a default that changes its SASS is a bug of the switch).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.offline_compile import BIN, compile_sm90, ptxas
from bench.offline_sm90 import type_of
from dsaserve.kernels import gluon_sparse_mla as G
from dsaserve.kernels import gluon_sparse_mla_dec_fp8 as DEC
from dsaserve.kernels import gluon_sparse_mla_ws as W

# the decode-schedule fp8 kernel's switch combinations (gluon_sparse_mla_dec_fp8.DEFAULT_SWITCHES is "pin-early")
DEC_CANDIDATES = {"plain": {"PIN": False}, "pin": {"PIN": True}, "pin-early": {"PIN": True, "EARLY_ROWS": True}}


def _lines(sass: str) -> list[tuple[int, str]]:
    return [(int(m.group(1), 16), m.group(2).strip()) for m in
            (re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", ln) for ln in sass.splitlines()) if m]


def _op(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split(" ")[0]


WS_PARTS = {216: ("WG0", "WG1"), 72: ("producer",)}  # setmaxnreg -> partitions, in warp_specialize's order
DEC_PARTS = dict(zip(DEC.DEC_REGS, (("WG0",), ("WG1",), ("producer",)), strict=True))  # gluon_sparse_mla_dec_fp8


def partitions(sass: str, parts: dict[int, tuple[str, ...]] | None = None) -> dict[str, dict[str, int]]:
    """Per consumer / producer partition: local (spill) bytes and the round loop's instructions, STL, LDL, HGMMA."""
    lines = _lines(sass)
    cuts = [i for i, (_, ins) in enumerate(lines) if "USETMAXREG" in ins] + [len(lines)]
    out, seen = {}, {}
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        seg, regs = lines[lo:hi], int(re.search(r"0x([0-9a-f]+)\s*$", lines[lo][1]).group(1), 16)
        names, k = (parts or WS_PARTS).get(regs, ()), seen.get(regs, 0)
        if k >= len(names):
            continue
        name, seen[regs] = names[k], k + 1
        slots = set()
        for _, ins in seg:
            if _op(ins).split(".")[0] in ("STL", "LDL"):
                off = re.search(r"\[R1(?:\+(0x[0-9a-f]+))?\]", ins)
                base = int(off.group(1), 16) if off and off.group(1) else 0
                width = 8 if ".64" in _op(ins) else 16 if ".128" in _op(ins) else 4
                slots.update(range(base, base + width, 4))
        back = [(int(b.group(1), 16), a) for a, ins in seg
                if (b := re.search(r"BRA (0x[0-9a-f]+)", ins)) and int(b.group(1), 16) < a]
        top, end = max(back, key=lambda x: x[1] - x[0]) if back else (0, -1)
        loop = [_op(ins).split(".")[0] for a, ins in seg if top <= a <= end]
        out[name] = {"local_B": 4 * len(slots), "loop": len(loop), "STL": loop.count("STL"),
                     "LDL": loop.count("LDL"), "HGMMA": loop.count("HGMMA")}
    return out


def report(name: str, splits: int | None, sass_dir: Path | None, fp8: bool = False, dec: bool = False) -> str:
    t = 4096
    qn, qr = torch.zeros(t, 64, 512, dtype=torch.bfloat16), torch.zeros(t, 64, 64, dtype=torch.bfloat16)
    rows = torch.zeros(8192, G.FP8_ROW, dtype=torch.uint8) if fp8 else torch.zeros(8192, 576, dtype=torch.bfloat16)
    slots = torch.zeros(t, 2048, dtype=torch.int32)
    cfg = {**G.DEFAULT, "ws": "dec" if dec else True, "splits": splits,
           "ws_variant": DEC_CANDIDATES[name] if dec else W.CANDIDATES[name]}
    kernel, _, _, _, args, meta = G.launch_plan(qn, qr, rows, slots, 0.06, torch.empty_like(qn), cfg, 132)
    compiled = compile_sm90(kernel, args, meta, type_of)
    with tempfile.TemporaryDirectory() as tmp:
        regs, spill, cubin = ptxas(compiled, Path(tmp))
        sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    if sass_dir:
        sass_dir.mkdir(parents=True, exist_ok=True)
        (sass_dir / f"{name}.sass").write_text(sass)
    parts = " | ".join(f"{p} {v['local_B']:3d} B local, loop {v['loop']} instr (STL {v['STL']} LDL {v['LDL']} "
                       f"HGMMA {v['HGMMA']})" for p, v in partitions(sass, DEC_PARTS if dec else None).items())
    return (f"{name:20s} spill st/ld {spill[0]:>3s}/{spill[1]:<3s} B smem {compiled.metadata.shared / 1024:.1f} KB"
            f" | {parts}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="variants (default: all of CANDIDATES)")
    ap.add_argument("--splits", type=int, default=None, help="top-k splits (default: unsplit, as prefill)")
    ap.add_argument("--sass", type=Path, default=None, help="a folder for each variant's SASS")
    ap.add_argument("--fp8", action="store_true", help="the fp8_ds_mla kernel (gluon_sparse_mla_ws_fp8: PIN only)")
    ap.add_argument("--dec", action="store_true", help="the decode-schedule fp8 kernel (gluon_sparse_mla_dec_fp8)")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    default = ",".join(DEC_CANDIDATES) if args.dec else "ws,pin" if args.fp8 else ",".join(W.CANDIDATES)
    for name in (args.only or default).split(","):
        print(report(name, args.splits, args.sass, args.fp8 or args.dec, args.dec), flush=True)


if __name__ == "__main__":
    main()
