"""Where one long row's fused indexer selection spends its time (issue 17: a full layer's selection in the batch-1
step, 16-20 µs alone on an H100 at 32K keys). The cooperative score + select kernel
(`triton_indexer_coop._coop_score_select_kernel`) is launched with STAMPS: each program records %clock64 and
%globaltimer at its phases (`_stamp`), so each phase's time is read per program, and each barrier's own latency as
the time from its last arrival to its first release. One row, decode's chunk (`variants.fused_select_chunk`), each
launch over its own pages (keys from HBM), the stamped launch's slots checked equal to the unstamped one's.

    PYTHONPATH=. python bench/probe_select_phases.py --out DIR [--keys 32768,131072] [--launches 12]
        [--modes poll,q_first_off,count_barrier,barriers]

Prints, per phase, the median over launches of the programs' median and slowest µs; writes probe_select_phases.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch

from bench.sweep_decode_b1 import graph_us, indexer_case
from dsaserve.kernels import triton_indexer_coop
from dsaserve.kernels.variants import fused_select_chunk

PS, IH, IDIM, TOPK = 64, 32, 128, 2048
# stamp i (`triton_indexer_coop`): where it is taken; a phase runs from one taken stamp to the next
STAMPS = ["entry", "PDL sync + role", "q + head weights", "scores", "chunk keys", "round 0 counted", "barrier 0",
          "round 1 counted", "barrier 1", "round 2 counted", "barrier 2", "round 3 counted", "barrier 3",
          "counts out", "counts in", "write"]
BARRIERS = {6: "barrier 0", 8: "barrier 1", 10: "barrier 2", 12: "barrier 3", 14: "counts in"}
# mode -> (HIST_POLL, COUNT_POLL, KEYS_FIRST): the rounds' histograms and the chunks' counts polled, or behind
# barriers; the scores in registers, the keys asked for before q is rounded, or q first and scores through memory
MODES = {"poll": (True, True, True), "q_first_off": (True, True, False), "count_barrier": (True, False, True),
         "barriers": (False, False, False)}
FLAGS = ("HIST_POLL", "COUNT_POLL", "KEYS_FIRST")


def read_stamps(scores: torch.Tensor, chunk: int) -> torch.Tensor:
    """[programs, 16, 2] (clock64, globaltimer) of one row's launch: the first 32 int64 of each chunk's scores."""
    words = scores[0].contiguous().view(torch.int64).view(-1, chunk // 2)[:, :32]
    return words.view(-1, 16, 2).cpu()


def phases(st: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per phase (stamp i -> the next taken stamp): the programs' median and slowest µs, by clock64 scaled to each
    program's globaltimer span; per barrier: last arrival -> first release (µs, globaltimer)."""
    taken = [i for i in range(16) if bool((st[:, i, 0] != 0).all())]
    clk, gt = st[..., 0].double(), st[..., 1].double()
    ns_per_clk = (gt[:, taken[-1]] - gt[:, taken[0]]) / (clk[:, taken[-1]] - clk[:, taken[0]])
    out = {}
    for a, b in zip(taken, taken[1:], strict=False):
        us = ((clk[:, b] - clk[:, a]) * ns_per_clk / 1e3).tolist()
        out[f"{STAMPS[a]} -> {STAMPS[b]}"] = {"median_us": statistics.median(us), "max_us": max(us)}
    for i, name in BARRIERS.items():
        if i in taken:
            arrive, release = gt[:, i - 1], gt[:, i]
            out[f"{name}: last arrival -> first release"] = {
                "median_us": float(release.min() - arrive.max()) / 1e3,
                "max_us": float(release.max() - arrive.max()) / 1e3}
    out["whole: first entry -> last end"] = {"median_us": float(gt[:, taken[-1]].max() - gt[:, 0].min()) / 1e3,
                                            "max_us": float(gt[:, taken[-1]].max() - gt[:, 0].min()) / 1e3}
    return out


def probe(keys: int, launches: int) -> dict:
    q, w, cache, tables, req, pos = indexer_case(launches, 1, keys, PS, IH, IDIM)
    chunk = fused_select_chunk(1, tables.shape[-1] * PS)
    out = torch.empty(1, TOPK, dtype=torch.int64, device="cuda")

    def launch(i: int, stamps: bool) -> torch.Tensor:
        kernel, grid, args, kw = triton_indexer_coop.score_select_launch(q[i], w[i], cache, tables[i], req, pos, out,
                                                                         TOPK, PS, chunk)
        kernel[grid](*args, **{**kw, "STAMPS": stamps})
        return args[4]

    runs = []
    for i in range(launches):
        launch(i, False)
        plain = out.clone()
        scores = launch(i, True)
        torch.cuda.synchronize()
        if not torch.equal(out, plain):
            raise SystemExit(f"probe_select_phases: the stamped launch {i} selected other slots")
        runs.append(phases(read_stamps(scores, chunk)))
    table = {name: {k: round(statistics.median(r[name][k] for r in runs if name in r), 3)
                    for k in ("median_us", "max_us")}
             for name in dict.fromkeys(n for r in runs for n in r)}
    return {"keys": keys, "chunk": chunk, "programs": -(-keys // chunk),
            "graph_us_plain": round(graph_us(lambda i: launch(i, False), launches), 2),
            "graph_us_stamped": round(graph_us(lambda i: launch(i, True), launches), 2), "phases": table}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--keys", default="32768,131072")
    ap.add_argument("--launches", type=int, default=12)
    ap.add_argument("--modes", default="poll,q_first_off,count_barrier,barriers",
                    help="the engine's selection (`HIST_POLL`, `COUNT_POLL`, `KEYS_FIRST`), its scores through memory, "
                    "its counts behind a barrier, or its rounds too (MODES)")
    args = ap.parse_args()
    torch.manual_seed(0)
    results, engine = [], [getattr(triton_indexer_coop, f) for f in FLAGS]
    for mode, keys in itertools.product(args.modes.split(","), (int(k) for k in args.keys.split(","))):
        for flag, value in zip(FLAGS, MODES[mode], strict=True):
            setattr(triton_indexer_coop, flag, value)
        res = {"mode": mode, **probe(keys, args.launches)}
        results.append(res)
        print(f"== {mode}: {keys} keys, chunk {res['chunk']} ({res['programs']} programs): graph-timed "
              f"{res['graph_us_plain']} µs a launch, stamped {res['graph_us_stamped']}", flush=True)
        for name, v in res["phases"].items():
            print(f"  {name:48s} median {v['median_us']:7.3f}  slowest {v['max_us']:7.3f} µs", flush=True)
    for flag, value in zip(FLAGS, engine, strict=True):
        setattr(triton_indexer_coop, flag, value)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "probe_select_phases.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
