"""Integer divisions in the shipped kernels' SASS, without a GPU (issue 17: the forty-fourth session found a fifth of
the fused selection's stall samples in int64 divisions by a runtime page size).

Each line of a kernel spec list (default: the packaged `engine/kernel_specs/*.jsonl`, the variants a served step
launches) is compiled for sm_90 as the precompiler does (`kernel_precompile.compiled_kernel`) and cuobjdump's SASS
is counted: `I2F.U32.RP` / `I2F.RP` open an unsigned / signed 32-bit division by a runtime value (~20 instructions
and a reciprocal); an int64 one checks the high words, then runs the 32-bit sequence or calls a slow path (a
`CALL.REL.NOINC` whose callee converts with I2F.U64.RP). A constant divisor compiles to shifts or a multiply-high
and counts nothing here; a float division's slow-path call is counted apart (`float_div_calls`). Static counts: a
division inside a loop counts once.

Run anywhere Triton is installed (the device's version gives the device's code: /tmp/t36 holds Triton 3.6):
  PYTHONPATH=. python bench/offline_spec_sass.py [--specs FILE ...] [--only REGEX] [--out FILE]
Prints one line a variant that divides (kernel, warps, counts, instructions) and the totals.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

from dsaserve.engine import kernel_precompile as kp

COUNTED = {"udiv32": r"I2F\.U32\.RP", "sdiv32": r"I2F\.RP", "int64_div_calls": None}


def sass(kernel) -> str:
    """cuobjdump -sass of a compiled kernel's cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([tool, "-sass", cubin], capture_output=True, text=True, check=True).stdout


def count(text: str) -> dict[str, int]:
    """The division markers and the instruction count of one kernel's SASS; calls split by their callee: an int64
    division's slow path (I2F.U64.RP or MUFU.RCP64H) or a float division's (its denormal and overflow cases)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    out = {k: sum(1 for _, op in ins if re.search(p, op)) for k, p in COUNTED.items() if p}
    body = {}
    for at in {int(m.group(1), 16) for _, op in ins if (m := re.search(r"CALL\.REL\.NOINC\s+0x([0-9a-f]+)", op))}:
        ops = [op for a, op in ins if a >= at]
        body[at] = ops[:next((i for i, op in enumerate(ops) if op.startswith("RET")), len(ops))]
    calls = [int(m.group(1), 16) for _, op in ins if (m := re.search(r"CALL\.REL\.NOINC\s+0x([0-9a-f]+)", op))]
    int64 = sum(1 for at in calls if any(re.search(r"I2F\.U64|MUFU\.RCP64H", op) for op in body[at]))
    return {**out, "int64_div_calls": int64, "float_div_calls": len(calls) - int64, "instructions": len(ins)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", nargs="*", type=Path, default=None, help="spec lists (default: the packaged ones)")
    ap.add_argument("--only", default="", help="a regex of kernel names")
    ap.add_argument("--out", type=Path, default=None, help="also write every variant's counts here (JSON)")
    args = ap.parse_args()
    paths = args.specs or sorted(Path(kp.__file__).with_name("kernel_specs").glob("*.jsonl"))
    rows = []
    for spec in kp.read_specs(paths):
        d = json.loads(spec)
        name = d["name"].rsplit(".", 1)[-1]
        if args.only and not re.search(args.only, name):
            continue
        try:
            row = {"kernel": name, "num_warps": d["options"].get("num_warps"), **count(sass(kp.compiled_kernel(spec)))}
        except Exception as e:  # a variant that does not compile here is reported, not fatal
            row = {"kernel": name, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        rows.append(row)
        if row.get("error") or any(row[k] for k in COUNTED):  # (float division calls alone are not listed)
            print(json.dumps(row), flush=True)
    divides = [r for r in rows if not r.get("error") and any(r[k] for k in COUNTED)]
    print(f"{len(rows)} variants, {len(divides)} with a runtime integer division, "
          f"{sum(1 for r in rows if r.get('error'))} not compiled here")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
