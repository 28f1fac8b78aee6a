"""Two versions of the engine timed in turns on one machine: `bench_gpu.py`'s decode steps of an old tree against
this one, in ABBA order (issue 17: step changes of tens of µs sit inside the spread between H200 machines, and
inside one machine's drift between runs).

Run on the device:  PYTHONPATH=. python bench/ab_turns.py --old DIR --out $OUT [--rounds 2] [--contexts ...]
DIR holds the old version's `dsaserve/` package and its `bench/bench_gpu.py` (e.g. `git archive REV dsaserve
bench | tar -x -C DIR` on the dev machine, then carried; the device copy has no git). Each turn runs that tree's
bench_gpu as a script with only its own root on PYTHONPATH (besides `--site`, for wheels), so `import dsaserve`
cannot find the other version: `python -m` would put the working directory first.
Why ABBA: in the twentieth and twenty-first sessions the old code ran first in every turn, and the new code was
~50 µs faster at a context where nothing it changed runs (bench/RESULTS.md): the order itself moved the steps.
ABBA (old, new, new, old, ...) puts each version first equally often. The summary gives, per (batch, context),
each version's steps and the mean of new - old over the turns, and each version's cost of a context over the
smallest one in the same run (a difference that the machine's drift cancels).
Writes ab_turns.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def order(rounds: int) -> list[str]:
    """ABBA turns: old, new, new, old, old, new, ... (2 x rounds runs)."""
    pairs = [("old", "new"), ("new", "old")]
    return [code for r in range(rounds) for code in pairs[r % 2]]


def steps(bench_json: dict, key: str = "step_ms") -> dict[tuple[int, int], float]:
    """(batch, context) -> ms a decode step (key "roofline_ms": its bound in the same run), from one bench_gpu.json."""
    return {(int(r["bs"]), int(r["ctx"])): float(r[key]) for r in bench_json["decode"] if key in r}


def summary(runs: list[tuple[str, dict[tuple[int, int], float]]],
            bounds: list[dict[tuple[int, int], float]] | None = None) -> dict:
    """Per (batch, context): each version's steps, the mean new - old (runs paired in turn order), each version's
    mean cost over the same run's smallest context of that batch, and (with `bounds`, each run's rooflines) each
    step's ratio to its own run's bound."""
    out = {}
    keys = sorted({k for _, s in runs for k in s})
    olds = [s for code, s in runs if code == "old"]
    news = [s for code, s in runs if code == "new"]
    for bs, ctx in keys:
        base = min(c for b, c in keys if b == bs)
        row = {"old_ms": [s.get((bs, ctx)) for s in olds], "new_ms": [s.get((bs, ctx)) for s in news]}
        pairs = [(o[(bs, ctx)], n[(bs, ctx)]) for o, n in zip(olds, news, strict=False)
                 if (bs, ctx) in o and (bs, ctx) in n]
        row["new_minus_old_us"] = round(1e3 * sum(n - o for o, n in pairs) / len(pairs), 1) if pairs else None
        for code, group in (("old", olds), ("new", news)):
            over = [1e3 * (s[(bs, ctx)] - s[(bs, base)]) for s in group if (bs, ctx) in s and (bs, base) in s]
            row[f"{code}_over_{base}_us"] = [round(x, 1) for x in over]
        if bounds is not None:
            for code in ("old", "new"):
                row[f"{code}_ratio"] = [round(s[(bs, ctx)] / b[(bs, ctx)], 3) if (bs, ctx) in s and (bs, ctx) in b
                                        else None for (c, s), b in zip(runs, bounds, strict=True) if c == code]
        out[f"{bs}x{ctx}"] = row
    return out


def run_turn(code: str, tree: Path, args, out_dir: Path) -> dict:
    """One bench_gpu run of `tree` -> its bench_gpu.json ({} when it failed: its log is kept)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (args.site, str(tree)) if p)}
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(tree / "bench" / "bench_gpu.py"), "--skip-hf", "--batches", args.batches,
               "--contexts", args.contexts, "--prefill", "2048", "--out", tmp]
        try:
            proc = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=args.timeout)
            found = Path(tmp) / "bench_gpu.json"
            if proc.returncode == 0 and found.exists():
                return json.loads(found.read_text())
            (out_dir / f"failed_{code}.log").write_text(proc.stdout[-4000:] + proc.stderr[-4000:])
        except subprocess.TimeoutExpired:
            (out_dir / f"failed_{code}.log").write_text(f"timed out after {args.timeout} s")
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="a tree with the old dsaserve/ and bench/bench_gpu.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds: each runs both versions once")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--contexts", default="1024,32768,131072")
    ap.add_argument("--site", default="", help="an extra PYTHONPATH entry first (the server wheels' folder)")
    ap.add_argument("--timeout", type=int, default=120)
    args = ap.parse_args()
    old = Path(args.old).resolve()
    if not (old / "dsaserve").is_dir() or not (old / "bench" / "bench_gpu.py").is_file():
        raise SystemExit(f"--old: {old} needs dsaserve/ and bench/bench_gpu.py")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs, bounds = [], []
    for code in order(args.rounds):
        found = run_turn(code, old if code == "old" else ROOT, args, out_dir)
        runs.append((code, steps(found) if found else {}))
        bounds.append(steps(found, "roofline_ms") if found else {})
        print(code, {f"{b}x{c}": ms for (b, c), ms in runs[-1][1].items()}, flush=True)
    result = {"order": [c for c, _ in runs], "summary": summary(runs, bounds)}
    (out_dir / "ab_turns.json").write_text(json.dumps(result, indent=1))
    for key, row in result["summary"].items():
        print(key, json.dumps(row))


if __name__ == "__main__":
    main()
