"""Sweep of the prefill indexer (issue 17): the tiled FP8 score GEMM of `triton_indexer_gemm` alone, the
selection alone and score + selection, beside the streaming kernel it replaces (`triton_indexer_prefill`)
and the FP8 GEMM peak measured in the same run.

Run on the device:  PYTHONPATH=. python bench/sweep_indexer_prefill.py --out $OUT   (<= 4 min on one H200)
CPU smoke test:     TRITON_INTERPRET=1 PYTHONPATH=. python bench/sweep_indexer_prefill.py --interpret --out DIR
Correctness evidence (bench/indexer_topk_evidence.py): SAMPLES rows a case, for the stream kernel and every
select, against float64 scores (exact rate, and for each mismatch the float64 gap between the best key left
out and the worst key taken over the FP8 kernel's measured score error, and their ranks) and, for the gemm
path, against the exact top-k of its own fp32 scores (a correct select is exact there).
Cases: one request, the last T tokens of a ctx-token prompt (8K x 8K, 4K x 32K, 2K x 128K), GLM-5.3's indexer
(32 heads x 128, top-2048, 64-token pages). FLOPs count the causal keys, as bench_kernels' indexer_prefill
section does: 2 x 32 x 128 x sum over tokens of (position + 1). Every variant is caught on its own (a config
that fails to compile or runs out of resources is printed and skipped). Writes sweep_indexer_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path

import torch

from bench import indexer_topk_evidence as E
from bench.bench_gpu import pipelined_time
from dsaserve.common.index_pages import pack_pages, read_rows
from dsaserve.common.kv_layout import encode_index_k
from dsaserve.kernels import triton_indexer_gemm as G
from dsaserve.kernels import triton_indexer_prefill as PRE

HEADS, DIM, TOPK, PS = 32, 128, 2048, 64
CASES = ((8192, 8192), (4096, 32768), (2048, 131072))
# (bt tokens, bs keys, tpp tiles a program, warps, stages): MMA N = bt x 32, M = bs. The H200 sweep of
# 2026-12-01 (10 configs): these three were the fastest at every case
SCORE_CONFIGS = [(8, 128, 8, 8, 3), (4, 64, 16, 4, 4), (4, 128, 16, 4, 4)]
# the full path with each select (config overrides), on the best score config. "auto" is the default: rows
# up to 16K keys, radix past that, 128 MB chunks for the radix (`chunk_tokens`); wsNM: an N MB chunk whatever the select
SELECTS = [("rows", {"select": "rows"}), ("radix c4096", {"select": "radix", "radix_chunk": 4096}),
           ("radix c2048", {"select": "radix", "radix_chunk": 2048}),
           ("radix c8192", {"select": "radix", "radix_chunk": 8192}),
           ("auto ws64M", {"select": "auto", "ws_budget": 64 << 20}),
           ("auto ws32M", {"select": "auto", "ws_budget": 32 << 20}),  # fits one L2 partition's share more often
           ("auto ws16M", {"select": "auto", "ws_budget": 16 << 20}),
           ("auto ws128M", {"select": "auto", "ws_budget": 128 << 20}),
           ("auto ws256M", {"select": "auto", "ws_budget": 256 << 20}),
           ("auto window", {"select": "auto", "window": True})]  # the radix select's window pass before round 0
SAMPLES = 16  # rows a case checks against float64 (evenly spaced over its tokens)
TIME_LIMIT_S = 120  # stop starting new variants past this (the whole run must stay under 2.5 min)
ROWS: list[dict] = []


def timer(fn, steps: int) -> float:
    """Seconds a call: one warm call, then `steps` back to back with one sync (CUDA events on the GPU)."""
    if torch.cuda.is_available():
        return pipelined_time(fn, steps)
    fn()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t) / steps


def fp8_peak(dev: str, n: int) -> float:
    """FLOP/s of torch._scaled_mm n^3 (tensor-wise scales), bench_kernels' FP8 ceiling."""
    a = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    return 2 * n**3 / timer(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), 10)


def inputs(t: int, ctx: int, dev: str, heads: int = HEADS, dim: int = DIM) -> tuple:
    """One request: the last t tokens of a ctx-token prompt, keys on randomly permuted pages."""
    pages = -(-ctx // PS)
    cache = pack_pages(encode_index_k(torch.randn(pages * PS, dim, device=dev), "fp8_ds_mla"), "fp8_ds_mla", dim, PS)
    table = torch.randperm(pages, device=dev).view(1, pages)
    req = torch.zeros(t, dtype=torch.int64, device=dev)
    pos = torch.arange(ctx - t, ctx, device=dev)
    q = torch.randn(t, heads, dim, device=dev, dtype=torch.bfloat16)
    w = torch.rand(t, heads, device=dev) * (heads ** -0.5 * dim ** -0.5) - 0.3 * heads ** -0.5 * dim ** -0.5
    return q, w, cache, table, req, pos


def record(case: str, what: str, sec: float, flops: float, peak: float, base: float | None, **extra) -> None:
    r = {"case": case, "what": what, "ms": sec * 1e3, "TFLOPs": flops / sec / 1e12, "of_fp8_peak": flops / sec / peak,
         "speedup_vs_stream": (base / sec) if base else None, **extra}
    ROWS.append(r)
    sp = f"{r['speedup_vs_stream']:.2f}x" if base else "-"
    print(f"{case:16s} {what:52s} {r['ms']:9.3f} ms {r['TFLOPs']:7.1f} TF/s {r['of_fp8_peak']:6.3f} of peak "
          f"{sp:>7s} vs stream", flush=True)


def attempt(label: str, fn):
    try:
        return fn()
    except Exception as ex:  # noqa: BLE001 - one failing variant must not stop the sweep
        print(f"FAILED {label}: {type(ex).__name__}: {str(ex)[:300]}", flush=True)
        traceback.print_exc(limit=2)
        return None


def score_only(ops, req, pos, t: int, ctx: int, conf: dict, steps: int) -> float:
    """The score GEMM over every chunk of the case (into one reused workspace), as gemm_topk runs it."""
    n_cols = -(-ctx // conf["bs"]) * conf["bs"]
    step = G.chunk_tokens(n_cols, conf)
    ws = torch.empty((min(step, t), n_cols), dtype=torch.float32, device=pos.device)

    def run():
        for t0 in range(0, t, step):
            G.chunk_scores(ops, req, pos, [ctx], [t], t0, min(t, t0 + step), ws, TOPK, conf)

    return timer(run, steps)


def select_only(ops, req, pos, table, t: int, ctx: int, conf: dict, steps: int) -> float:
    """Seconds of the selection alone over every workspace chunk of the case (the chunk's scores computed
    before its timing), as gemm_topk runs it."""
    n_cols = -(-ctx // conf["bs"]) * conf["bs"]
    step = G.chunk_tokens(n_cols, conf)
    ws = torch.empty((min(step, t), n_cols), dtype=torch.float32, device=pos.device)
    out = torch.empty((t, TOPK), dtype=torch.int64, device=pos.device)
    total = 0.0
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        G.chunk_scores(ops, req, pos, [ctx], [t], t0, t1, ws, TOPK, conf)
        total += timer(lambda t0=t0, t1=t1: G._select(ws[:t1 - t0], table, req[t0:t1], pos[t0:t1], out[t0:t1], TOPK,
                                                      PS, conf["select"], conf["radix_chunk"], conf["window"]), steps)
    return total


def agreement(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Fraction of rows whose slot sets are equal (rows parting at near-ties of the k-th score differ)."""
    return float((got.sort(1).values == ref.sort(1).values).all(1).float().mean())


class Truth:
    """Float64 scores of sampled rows (q rounded to e4m3 as prepare_q does, keys decoded from the cache) and the
    gemm kernel's own fp32 scores of the same rows, for `evidence.row_evidence`."""

    def __init__(self, q, w, cache, table, pos, ctx: int, ops, conf: dict):
        from dsaserve.common.kv_layout import decode_index_k

        j = torch.arange(ctx, device=pos.device)
        rows = read_rows(cache, table[0, j // PS] * PS + j % PS, "fp8_ds_mla", q.shape[-1])
        keys = decode_index_k(rows, "fp8_ds_mla").double()
        q8, w8 = G.prepare_q(q, w, True)
        h = q.shape[1]
        self.rows = [r for r in torch.linspace(0, len(pos) - 1, SAMPLES).long().tolist() if int(pos[r]) >= TOPK]
        self.pos, self.slots = pos, table[0, j // PS] * PS + j % PS
        self.s64, self.own = {}, {}
        n_cols = -(-ctx // conf["bs"]) * conf["bs"]
        step = G.chunk_tokens(n_cols, conf)  # gemm_topk's chunks and blocks
        for r in self.rows:
            p = int(pos[r])
            qd = q8[r].view(torch.float8_e4m3fn).double()[:h]
            self.s64[r] = ((qd @ keys[:p + 1].t()).relu() * w8[r, :h, None].double()).sum(0)
            b0 = r - (r % step) % conf["bt"]
            ws = torch.full((conf["bt"], n_cols), float("nan"), device=pos.device)
            G.chunk_scores(ops, torch.zeros_like(pos), pos, [ctx], [len(pos)], b0, b0 + conf["bt"], ws, TOPK, conf)
            self.own[r] = ws[r - b0, :p + 1].clone()

    def check(self, got: torch.Tensor, own_is_the_kernels: bool) -> tuple[dict, list[dict]]:
        """got [T, TOPK] slots -> (summary, per-row evidence) over the sampled rows."""
        where = torch.full((int(self.slots.max()) + 1,), -1, dtype=torch.int64, device=got.device)
        where[self.slots] = torch.arange(len(self.slots), device=got.device)
        rows = []
        for r in self.rows:
            taken = where[got[r][got[r] >= 0]]
            ev = E.row_evidence(taken, self.s64[r], TOPK, self.own[r], own_is_the_kernels)
            rows.append({"row": r, "position": int(self.pos[r]), **ev})
        return E.summarize(rows), rows


def report_evidence(what: str, summary: dict, rows: list[dict]) -> None:
    s = summary
    ratio = "-" if s["max_gap_over_err"] is None else f"{s['max_gap_over_err']:.2f}"
    own = "-" if s["own_exact_rate"] is None else f"{s['own_exact_rate']:.2f}"
    print(f"    {what:28s} {E.verdict(s):12s} exact-vs-f64 {s['exact_rate']:.2f}  exact-vs-own-fp32 {own}  "
          f"max swapped {s['max_swapped']}  max gap/err {ratio}  max gap {s['max_gap_rel']:.1e} of max|s|  "
          f"ranks: best left out {s['min_missing_rank']}, worst taken {s['max_extra_rank']} (k={TOPK})", flush=True)
    for r in rows:
        if not r["exact"] and (r["gap_over_err"] is None or r["gap_over_err"] > 2.0):
            print(f"      row {r['row']} (pos {r['position']}): {r}", flush=True)


def run_case(t: int, ctx: int, peak: float, dev: str, steps: int, t_start: float) -> None:
    case = f"T={t} ctx={ctx}"
    torch.manual_seed(0)  # the same inputs in every run: select times comparable across runs
    q, w, cache, table, req, pos = inputs(t, ctx, dev)
    flops = 2.0 * HEADS * DIM * sum(range(ctx - t + 1, ctx + 1))
    stream = lambda: PRE.prefill_topk(q, w, cache, "fp8_ds_mla", table, req, pos, TOPK, PS, [ctx], [t])  # noqa: E731
    base = attempt("stream", lambda: timer(stream, steps))
    ops = (*G.prepare_q(q, w, True), *G.gather_keys(cache, table, [ctx], [t], PS, DIM))
    prep = timer(lambda: (G.prepare_q(q, w, True), G.gather_keys(cache, table, [ctx], [t], PS, DIM)), steps)
    best = None
    for i, (bt, bs, tpp, nw, ns) in enumerate(SCORE_CONFIGS):
        if i and time.time() - t_start > TIME_LIMIT_S:  # every case runs at least the first config
            print("time limit: skipping the remaining score configs", flush=True)
            break
        conf = {**G.DEFAULT_CONFIG, "bt": bt, "bs": bs, "tpp": tpp, "num_warps": nw, "num_stages": ns}
        sec = attempt(f"scores {conf}", lambda conf=conf: score_only(ops, req, pos, t, ctx, conf, steps))
        if sec:
            record(case, f"new: scores only bt{bt} bs{bs} tpp{tpp} w{nw} s{ns}", sec, flops, peak, base,
                   config=conf)
            if best is None or sec < best[0]:
                best = (sec, conf)
    if best is None:
        return
    truth = Truth(q, w, cache, table, pos, ctx, ops, best[1])
    ref = stream() if base else None
    if base:
        summary, rows = truth.check(ref, own_is_the_kernels=False)
        record(case, "current: stream GEMM + streaming top-k", base, flops, peak, base, evidence=summary,
               evidence_rows=rows)
        report_evidence("stream (err from gemm scores)", summary, rows)
    record(case, "new: prepare q (fp8) + gather keys", prep, flops, peak, base)
    for i, (label, overrides) in enumerate(SELECTS):
        if i > 1 and time.time() - t_start > TIME_LIMIT_S + 20:  # rows and radix c4096 always run
            print("time limit: skipping the remaining selects", flush=True)
            break
        full = {**best[1], **overrides}
        run = lambda full=full: G.gemm_topk(q, w, cache, "fp8_ds_mla", table, req, pos, TOPK, PS, [ctx], [t],  # noqa: E731
                                            config=full)
        sec = attempt(f"full {label}", lambda run=run: timer(run, steps))
        if not sec:
            continue
        got = run()
        summary, rows = truth.check(got, own_is_the_kernels=True)
        alone = attempt(f"select only {label}",
                        lambda full=full: select_only(ops, req, pos, table, t, ctx, full, steps))
        record(case, f"new: full (prep + best scores + {label} select)", sec, flops, peak, base, config=full,
               rows_equal_to_stream=agreement(got, ref) if ref is not None else None,
               select_ms=alone * 1e3 if alone else None, select_ms_by_difference=(sec - best[0] - prep) * 1e3,
               evidence=summary, evidence_rows=rows)
        print(f"    rows equal to the stream kernel's: {ROWS[-1]['rows_equal_to_stream']}, select alone "
              f"{ROWS[-1]['select_ms'] or float('nan'):.3f} ms (full - scores - prep: "
              f"{ROWS[-1]['select_ms_by_difference']:.3f} ms)", flush=True)
        report_evidence(label, summary, rows)


def summary_table() -> None:
    """The full-path rows and the stream's, one line each: time, speedup, select time, correctness verdict."""
    print(f"\n{'case':16s} {'variant':28s} {'ms':>8s} {'vs stream':>9s} {'select ms':>9s} {'verdict':12s} "
          f"{'f64 exact':>9s} {'own exact':>9s} {'=stream':>7s} {'max gap/err':>11s}")
    for r in ROWS:
        ev = r.get("evidence")
        if ev is None:
            continue
        name = r["what"].split("+ ")[-1].replace(" select)", "") if "full" in r["what"] else "stream"
        fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
        print(f"{r['case']:16s} {name:28s} {r['ms']:8.3f} {fmt(r['speedup_vs_stream'], '8.2f') + 'x':>9s} "
              f"{fmt(r.get('select_ms'), '9.3f'):>9s} {E.verdict(ev):12s} {ev['exact_rate']:9.2f} "
              f"{fmt(ev['own_exact_rate'], '9.2f'):>9s} {fmt(r.get('rows_equal_to_stream'), '7.3f'):>7s} "
              f"{fmt(ev['max_gap_over_err'], '11.2f'):>11s}")


def main(argv: list[str] | None = None) -> None:
    global CASES, SCORE_CONFIGS, SELECTS, TOPK, PS, TIME_LIMIT_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--interpret", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cases", default=None, help="TxCTX,... (default: every case)")
    ap.add_argument("--selects", default=None, help="select names to run, comma-separated (default: all)")
    ap.add_argument("--score-configs", type=int, default=None, help="only the first N score configs")
    args = ap.parse_args(argv)
    if args.cases:
        CASES = tuple(tuple(int(x) for x in c.split("x")) for c in args.cases.split(","))
    if args.selects:
        keep = set(args.selects.split(","))
        SELECTS = [s for s in SELECTS if s[0] in keep]
    if args.score_configs:
        SCORE_CONFIGS = SCORE_CONFIGS[:args.score_configs]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.interpret:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--interpret needs TRITON_INTERPRET=1")
        os.environ.setdefault("DSASERVE_TEST_TRITON_INTERPRET", "1")
        from tests.kernels import gpu_common  # noqa: F401 - patches the interpreter's e4m3 rounding (as tests do)

        CASES, TOPK, PS, args.steps, TIME_LIMIT_S = ((12, 160),), 32, 16, 1, 1e9
        SCORE_CONFIGS = [(4, 32, 2, 4, 2), (2, 16, 4, 4, 2)]
        SELECTS = [("rows", {"select": "rows"}), ("radix c128", {"select": "radix", "radix_chunk": 128})]
    t_start = time.time()
    peak = fp8_peak(dev, 256 if args.interpret else 8192)
    print(f"FP8 peak (_scaled_mm, this run): {peak / 1e12:.1f} TFLOP/s", flush=True)
    for t, ctx in CASES:
        attempt(f"case {t}x{ctx}", lambda t=t, ctx=ctx: run_case(t, ctx, peak, dev, args.steps, t_start))
        if dev == "cuda":
            torch.cuda.empty_cache()
    summary_table()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep_indexer_prefill.json").write_text(json.dumps({"fp8_peak_TFLOPs": peak / 1e12, "rows": ROWS},
                                                               indent=1))
    print(f"wrote {out / 'sweep_indexer_prefill.json'} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
