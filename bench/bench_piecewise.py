"""Piecewise CUDA graphs vs eager on mixed prefill + decode steps (issue 16), and warmup coverage.

Run on the device:  PYTHONPATH=. python bench/bench_piecewise.py --out $OUT [--config glm-5.3-slice]
Each case is one step: `--decode` rows decoding at `--context` tokens of context plus one prefill chunk
of P tokens (`--chunks`, default 256,1024,4096; 0 = decode rows only), as the scheduler forms them, handed
over as a host batch. Timed three ways, on the same runner and pool (random KV, dummy weights):
  eager      ModelRunner's eager path: batch.to(device) + the plain forward (what these steps ran before)
  piecewise  the piecewise graphs: one staging copy, a replay per segment, the attention cores eagerly
  decode     (chunk 0 only) the decode graph of the decode rows
`step_ms` is a synchronous step (what a scheduler that waits for its logits sees), `pipelined_ms` steps
issued back to back (the GPU-bound time, the host hidden), `host_ms` the host time to issue one step.
Also: the logits of eager and piecewise agree (relative L2 distance, argmax agreement), the startup
seconds of capture and warmup, and the compile counters after all cases (`kernel_compiles_after_up`,
`kernel_loads_after_up`: every case shape was warmed, so they must stay 0).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.bench_gpu import cuda_time, fill_pool, pipelined_time
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import ForwardBatch, contiguous_batch


def mixed_batch(decode: int, context: int, chunk: int, page_size: int, vocab: int) -> ForwardBatch:
    """`decode` rows at `context` tokens each + one `chunk`-token prompt from position 0, disjoint pages."""
    per = -(-(context + 1) // page_size) * page_size
    g = torch.Generator().manual_seed(chunk)
    tokens = [[int(t)] for t in torch.randint(2, vocab, (decode,), generator=g)]
    prefix, bases = [context] * decode, [r * per for r in range(decode)]
    if chunk:
        tokens.append(torch.randint(2, vocab, (chunk,), generator=g).tolist())
        prefix.append(0)
        bases.append(decode * per)
    return contiguous_batch(tokens, prefix, bases, page_size)


def host_ms(fn, reps: int = 20) -> float:
    """Median host milliseconds to issue one step (each rep after a sync: an empty launch queue)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def timings(fn) -> dict:
    return {"step_ms": cuda_time(fn) * 1e3, "pipelined_ms": pipelined_time(fn) * 1e3, "host_ms": host_ms(fn)}


def measure(runner: ModelRunner, batch: ForwardBatch, mode: str) -> dict:
    """Timings of one path for one batch, and its logits (float, on the device)."""
    if mode == "eager":
        fn = lambda: runner.model(batch.to(runner.device), runner.kv_pool)[0]  # noqa: E731
    elif mode == "piecewise":
        fn = lambda: runner.piecewise.forward(batch)  # noqa: E731
    else:
        fn = lambda: runner.graphs.replay(batch)  # noqa: E731
    return {"logits": fn().float().clone(), **timings(fn)}


def cases(runner: ModelRunner, decode: int, context: int, chunks: list[int]) -> tuple[list[dict], dict]:
    """Every case on the graph paths first (the counters after them: what serving would have compiled),
    then the eager baselines (which compile their own variants)."""
    batches = [mixed_batch(decode, context, c, runner.page_size, runner.cfg.vocab_size) for c in chunks]
    graphs = [{"piecewise": measure(runner, b, "piecewise")}
              | ({"decode": measure(runner, b, "decode")} if not c and runner.graphs is not None else {})
              for b, c in zip(batches, chunks, strict=True)]
    after = runner.compile_cache.compiles_after_up() | runner.kernel_loads.read()
    rows = []
    for b, c, g in zip(batches, chunks, graphs, strict=True):
        g["eager"] = measure(runner, b, "eager")
        ref, got = g["eager"].pop("logits"), g["piecewise"].pop("logits")
        g.get("decode", {}).pop("logits", None)
        rows.append({"decode_rows": decode, "context": context, "chunk": c, "tokens": b.num_tokens,
                     "bucket": next(x for x in runner.piecewise.buckets if x >= b.num_tokens),
                     "route": runner.route(b), "logits_rel_l2": float((got - ref).norm() / ref.norm()),
                     "argmax_agree": float((got.argmax(-1) == ref.argmax(-1)).float().mean()), **g,
                     "speedup_step": g["eager"]["step_ms"] / g["piecewise"]["step_ms"]})
    return rows, after


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="glm-5.3-slice")
    ap.add_argument("--out", default="bench-piecewise-out")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunks", default="0,256,1024,4096")
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    per = -(-(args.context + 1) // 64)
    max_tokens = max(chunks) + args.decode
    t0 = time.perf_counter()
    runner = ModelRunner.from_kwargs(args.config, dtype="bfloat16", load_format="dummy", device="cuda",
                                     num_pages=args.decode * per + -(-max(chunks) // 64) + 8,
                                     max_num_batched_tokens=max_tokens, max_running_requests=max(args.decode + 1, 8),
                                     max_model_len=max(args.context + 64, max(chunks) + 64))
    startup_s = time.perf_counter() - t0
    assert runner.piecewise is not None, runner.manifest()["piecewise_cuda_graph"]
    fill_pool(runner.kv_pool, runner.cfg)
    rows, after = cases(runner, args.decode, args.context, chunks)
    m = runner.manifest()
    report = {"config": args.config, "startup_s": startup_s, "startup_time": m["startup_time"],
              "piecewise": m["piecewise_cuda_graph"], "decode_graphs": m["cuda_graph"]["buckets"],
              "warmed": m["warmed_shapes"], "cases": rows, "compiles_after_graph_cases": after}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_piecewise.json").write_text(json.dumps(report, indent=1))
    for r in rows:
        e, p, d = r["eager"], r["piecewise"], r.get("decode", {}).get("step_ms")
        print(f"decode {r['decode_rows']:3d} + chunk {r['chunk']:5d} ({r['tokens']} tok, bucket {r['bucket']}, "
              f"{r['route']}): eager {e['step_ms']:7.2f} ms  piecewise {p['step_ms']:7.2f} ms  "
              f"x{r['speedup_step']:.2f}  (pipelined {e['pipelined_ms']:.2f} / {p['pipelined_ms']:.2f}, "
              f"host {e['host_ms']:.2f} / {p['host_ms']:.2f})" + (f"  decode graph {d:.2f} ms" if d else "")
              + f"  rel {r['logits_rel_l2']:.1e} agree {r['argmax_agree']:.2f}")
    print("capture", m["piecewise_cuda_graph"], "\ncompiles after the graph cases (must be 0):", after)


if __name__ == "__main__":
    main()
