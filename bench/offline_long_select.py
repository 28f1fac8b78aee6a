"""Offline sm_90 instruction census of the split radix select's kernels (kernels/triton_indexer_long.py), without a
GPU (the design before them, whose counts bench/RESULTS.md and the module docstring compare, is bench/long_select_v0.py
at commit ebc515b): registers, spills and, per kernel, the SASS
instruction count of every entry-to-EXIT path of the CFG (a loop body once), grouped by what the path does
(an early return; a round's ballot histogram or not ("plain": no key matched, or per-key atomics, each
atomic's short skip counted taken); "+last": the row's last program's bookkeeping). Counts are per thread, one
path at a time; 16 keys a thread at either chunk size.

Run:  PYTHONPATH=<Triton 3.6 site-packages>:. python bench/offline_long_select.py [--chunk 2048]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from bench.offline_compile import BIN, compile_sm90, ptxas
from bench.offline_sm90 import type_of
from dsaserve.kernels import triton_indexer_long

MARKS = ("VOTE", "REDG", "STG")


def _paths(ins: list[str], addrs: list[int]) -> list[tuple[int, dict]]:
    """(instructions, marker counts) of every path: a predicated branch or EXIT forks, a back edge is dropped."""
    at = {a: i for i, a in enumerate(addrs)}
    out: list[tuple[int, dict]] = []

    def walk(i: int, n: int, marks: dict) -> None:
        while i < len(ins) and len(out) < 50000:
            text = ins[i]
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split(" ")[0].split(".")[0]
            pred = text.startswith("@")
            n += op != "NOP"
            if op in MARKS:
                marks = {**marks, op: marks.get(op, 0) + 1}
            if op == "EXIT":
                if pred:
                    walk(i + 1, n, marks)
                out.append((n, marks))
                return
            if op == "BRA":
                m = re.search(r"(0x[0-9a-f]+)", text)
                tgt = at.get(int(m.group(1), 16)) if m else None
                if tgt is not None and tgt > i:
                    if pred and tgt - i > 6:  # a short skip (one key's atomic) is counted taken: no fork
                        walk(tgt, n, marks)
                    else:
                        i = tgt
                        continue
                elif tgt is not None and not pred:  # a loop's back edge: the body counted once
                    return
            i += 1

    walk(0, 0, {})
    return out


def census(cubin: Path, cubin_name: str = "") -> str:
    text = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    rows = [(int(m.group(1), 16), m.group(2).strip()) for m in
            (re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", ln) for ln in text.splitlines()) if m]
    groups: dict[str, tuple[int, int]] = {}
    for n, marks in _paths([t for _, t in rows], [a for a, _ in rows]):
        what = "hist" if marks.get("VOTE") else "atomics" if marks.get("REDG") else "plain"
        last = marks.get("STG", 0) >= 3 and "write" not in cubin_name
        what = "return" if n < 60 else what + (" +last" if last else "")
        lo, hi = groups.get(what, (1 << 30, 0))
        groups[what] = (min(lo, n), max(hi, n))
    return "  ".join(f"{k} {lo}" + (f"-{hi}" if hi != lo else "") for k, (lo, hi) in sorted(groups.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk", type=int, default=2048)
    args = ap.parse_args()
    ops = (torch.empty(2, 2048 * 64), torch.zeros(1, 2048, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
           torch.zeros(2, dtype=torch.int64), torch.empty(2, 2048, dtype=torch.int64))
    plain = triton_indexer_long.launches(*ops, 2048, 64, args.chunk, window=False, late_slots=False)
    windowed = triton_indexer_long.launches(*ops, 2048, 64, args.chunk, window=True, late_slots=True)
    # the pass and round 0 behind it; the write storing positions and the launch that maps them to slots
    for kernel, _, launch_args, kwargs in plain + windowed[:2] + windowed[-2:]:
        meta = {k: v for k, v in kwargs.items() if k != "launch_pdl"}
        with tempfile.TemporaryDirectory() as tmp:
            regs, spill, cubin = ptxas(compile_sm90(kernel, launch_args, meta, type_of), Path(tmp))
            paths = census(cubin, kernel.fn.__name__)
        label = kernel.fn.__name__ + (f"[{kwargs['ROUND']}]" if "ROUND" in kwargs else "") + (
            "[positions]" if kwargs.get("SLOTS") is False else "")
        print(f"chunk {args.chunk} {label:24s} regs {regs:>3s} spill {spill[0]}/{spill[1]}  {paths}", flush=True)


if __name__ == "__main__":
    main()
