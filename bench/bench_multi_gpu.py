"""Several GPUs (issue: "Several GPUs measured"): decode steps and prefills of one layout per run, every rank a
process of its own over NCCL, each number beside its roofline and the ledger, all from the same run.

    PYTHONPATH=. python bench/bench_multi_gpu.py --out DIR --config glm-5.3-slice --layout tp2
    layouts: tp1, tp2, ep2 (replicated attention + EP2), tp2ep2, dp2ep2 (DP-attention + EP2)

Per GPU: the bytes a step must read (weights the rank holds and touches + the KV and indexer rows its own
requests read; bench_gpu.decode_bytes) over the copy bandwidth measured on that GPU, plus the bytes the rank
puts on NVLink (the counting wrapper's `collective_wire_bytes`) over the all-reduce bus bandwidth measured in
the same run. Communication is measured by replaying the step's counted collectives (same kinds, calls and
message sizes) on their own inside a CUDA graph, and set beside the ledger's `step_plan` time for the same
deployment (under DP-attention: for the step the ranks agreed on, padded gather or all-to-all) — twice: with
the H200 preset as it stands, and with its per-collective latency replaced by the one this run measured.
Under DP-attention a deployment batch of B is split over the ranks (B=1: rank 1 runs the idle step).

The latency sweep (every multi-GPU run, `--no-latency-sweep` to skip): all_reduce / all_gather /
reduce_scatter of decode-step sizes, 32 calls back to back in one CUDA graph per size (4 KiB - 4 MiB: one
token's hidden row to a 128-token batch's), seconds per call fitted to latency + wire bytes / bandwidth
(`dsaserve.ledger.hardware.fit_latency`). Each decode row then carries the ledger's time with the preset, with
the measured latency, and with the measured latency and the sweep's bandwidth; the run ends by printing the
ledger's hook with the measured value (`H200_NVLINK_LATENCY_S` in dsaserve/ledger/hardware.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import bench_prefill, cuda_time, decode_bytes, fill_pool, measure_ceilings  # noqa: E402

from dsaserve.common.counters import COUNTERS, ring_wire_factor  # noqa: E402
from dsaserve.common.wire import free_port  # noqa: E402
from dsaserve.distributed import collectives  # noqa: E402
from dsaserve.distributed.parallel_state import get_parallel_state  # noqa: E402
from dsaserve.engine.memory_profile import dummy_decode  # noqa: E402
from dsaserve.engine.model_runner import ModelRunner  # noqa: E402
from dsaserve.ledger.collective_plan import row_time, step_plan  # noqa: E402
from dsaserve.ledger.deployment import Assumptions, Deployment  # noqa: E402
from dsaserve.ledger.hardware import Hardware, fit_latency, get_hardware  # noqa: E402
from dsaserve.model.layers.moe import fold_device_expert_counts  # noqa: E402

LAYOUTS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "ep2": {"expert_parallel_size": 2},
           "tp2ep2": {"tensor_parallel_size": 2, "expert_parallel_size": 2},
           "dp2ep2": {"enable_dp_attention": True, "expert_parallel_size": 2}}


def link_bandwidth(group) -> dict:
    """All-reduce bus bandwidth (what a rank puts on the wire per second) at 256 MiB, NCCL's own measure."""
    x = torch.ones(128 << 20, dtype=torch.bfloat16, device="cuda")
    n = group.size
    t = cuda_time(lambda: collectives.all_reduce(x, group), iters=10)
    return {"allreduce_bus_bytes_per_s": x.numel() * 2 * 2 * (n - 1) / n / t}


def counted(before: dict) -> dict:
    return {k: v for k, v in COUNTERS.diff(COUNTERS.snapshot(), before).items() if k.startswith("collective")}


def replay_collectives(delta: dict, group) -> float:
    """Seconds to run the step's counted collectives on their own: per kind, its calls at its mean message."""
    if group.size == 1:
        return 0.0
    every: list[dict] = [{} for _ in range(group.size)]
    dist.all_gather_object(every, delta)  # ranks' messages differ under DP-attention: replay the largest
    calls = []
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        n = max(round(d.get(f"collective_calls.{kind}", 0)) for d in every)
        if n:
            message = max(d.get(f"collective_bytes.{kind}", 0) / max(d.get(f"collective_calls.{kind}", 1), 1)
                          for d in every)
            calls.append((kind, n, max(int(message // 2), group.size)))

    bufs = [(kind, n, torch.ones(elems, dtype=torch.bfloat16, device="cuda")) for kind, n, elems in calls]

    def run() -> None:
        for kind, n, x in bufs:
            for _ in range(n):
                _one_collective(kind, x, group)
    return graph_seconds(run)


def graph_seconds(run, calls: int = 1) -> float:
    """Seconds per call of `run()` (which makes `calls` collectives) replayed inside one CUDA graph, as the
    decode graphs run them: no per-call host launch."""
    run()  # NCCL's first call of a shape sets up its channels: not inside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return cuda_time(graph.replay, iters=10, warmup=2) / calls


SWEEP_KINDS = ("all_reduce", "all_gather", "reduce_scatter")
SWEEP_BYTES = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)  # messages, as the wrapper counts them


def latency_sweep(group, calls: int = 32) -> dict:
    """Per-kind latency and bandwidth of decode-size collectives inside a CUDA graph: (wire bytes, seconds per
    call) points fitted to latency + wire / bandwidth; `latency_s_mean` is the value for the ledger's one
    per-collective term (the kinds are printed beside it), `bytes_per_s_mean` the bandwidth at these sizes."""
    out: dict = {"calls_per_graph": calls, "points": {}, "latency_s": {}, "bytes_per_s": {}}
    for kind in SWEEP_KINDS:
        points = []
        for nbytes in SWEEP_BYTES:
            x = torch.zeros(nbytes // 2, dtype=torch.bfloat16, device="cuda")

            def run(kind=kind, x=x) -> None:
                for _ in range(calls):
                    _one_collective(kind, x, group)
            points.append((nbytes * ring_wire_factor(kind, group.size), graph_seconds(run, calls)))
        out["points"][kind] = points
        out["latency_s"][kind], out["bytes_per_s"][kind] = fit_latency(points)
    out["latency_s_mean"] = statistics.mean(out["latency_s"].values())
    out["bytes_per_s_mean"] = statistics.mean(out["bytes_per_s"].values())  # inf if one kind never slowed down
    return out


def _one_collective(kind: str, x: torch.Tensor, group) -> None:
    n = group.size
    if kind == "all_reduce":
        collectives.all_reduce(x, group)
    elif kind == "all_gather":
        collectives.all_gather(x[: max(x.numel() // n, 1)], group)
    elif kind == "reduce_scatter":
        collectives.reduce_scatter(x[: x.numel() - x.numel() % n], group)
    elif kind == "all_to_all":
        per = x.numel() // n
        collectives.all_to_all(x[: per * n], [per] * n, [per] * n, group)


def ledger_comm_s(cfg, layout: dict, tokens: int, hw: Hardware, dp_step=None) -> float:
    """The ledger's communication time of one decode step of `tokens` (DP-attention: of the step the ranks
    agreed on, `ModelRunner.dp_step`: padded gather at its rows, or the all-to-all exchange)."""
    tp, ep = layout.get("tensor_parallel_size", 1), layout.get("expert_parallel_size", 1)
    dp = layout.get("enable_dp_attention", False)
    if max(tp, ep) == 1:
        return 0.0
    dep = Deployment(tp=tp, ep=ep, dp_attention=dp)
    gather = dp and dp_step is not None and dp_step.mode == "gather"
    asm = Assumptions(dp_moe="padded" if gather else "a2a") if dp else Assumptions()
    rows = dp_step.rows if gather else None
    return sum(row_time(r, hw, asm) for r in step_plan(cfg, dep, asm, tokens, tokens, rank_rows=rows))


def local_batch(bs: int, state) -> int:
    if not state.dp_attention:
        return bs
    share = -(-bs // state.world_size)
    return max(0, min(share, bs - state.rank * share))


def decode_rows(runner, ceil, link, layout, batches, contexts, sweep: dict | None) -> list[dict]:
    state, g = get_parallel_state(), get_parallel_state().world
    preset = get_hardware("h200")
    latency = preset.with_overrides(nvlink_overhead_s=sweep["latency_s_mean"]) if sweep else None
    both = latency.with_overrides(nvlink_bw=min(sweep["bytes_per_s_mean"], 1e15)) if sweep else None
    rows = []
    for ctx in contexts:
        for bs in batches:
            mine = local_batch(bs, state)
            pages = -(-(ctx + 1) // runner.page_size)
            if max(mine, 1) * pages > runner.num_pages:
                rows.append({"bs": bs, "ctx": ctx, "skipped": "pool too small"})
                continue
            seed = mine + 7919 * state.rank if state.dp_attention else None  # DP ranks: their own requests
            batch = dummy_decode(mine, ctx, runner.page_size, "cpu", runner.cfg.vocab_size, seed) if mine else None
            step = (lambda b=batch: runner.forward(b)) if mine else runner.forward_idle
            fold_device_expert_counts(reset=True)
            if g.size > 1:
                dist.barrier()
            before = COUNTERS.snapshot()
            t = cuda_time(step, iters=20, warmup=3)
            delta = {k: v / 23 for k, v in counted(before).items()}
            touched = fold_device_expert_counts(reset=True)
            need = decode_bytes(runner, mine, ctx, touched["weight_bytes_read"] / 23) if mine else {"total": 0.0}
            wire = sum(v for k, v in delta.items() if k.startswith("collective_wire_bytes."))
            hbm_s, link_s = need["total"] / ceil["copy_bytes_per_s"], wire / link["allreduce_bus_bytes_per_s"]
            comm = replay_collectives(delta, g)
            dp = runner.dp_step
            rows.append({"bs": bs, "ctx": ctx, "local_bs": mine, "step_ms": t * 1e3, "hbm_ms": hbm_s * 1e3,
                         "link_ms": link_s * 1e3, "roofline_ms": (hbm_s + link_s) * 1e3,
                         "ratio": t / (hbm_s + link_s) if hbm_s + link_s else None,
                         "tokens_per_s": bs / t, "collectives": delta, "comm_measured_ms": comm * 1e3,
                         "dp_step": dp.__dict__ if dp else None,
                         "comm_ledger_ms": ledger_comm_s(runner.cfg, layout, bs, preset, dp) * 1e3,
                         "comm_ledger_calibrated_ms": ledger_comm_s(runner.cfg, layout, bs, latency, dp) * 1e3
                         if latency else None,  # the measured latency
                         "comm_ledger_calibrated_bw_ms": ledger_comm_s(runner.cfg, layout, bs, both, dp) * 1e3
                         if both else None})  # ... and the sweep's bandwidth
    return rows


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    layout = LAYOUTS[args.layout]
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    prefill = [int(x) for x in args.prefill.split(",") if x]
    chunk = max(prefill + [2048])
    runner = ModelRunner.from_kwargs(
        args.config, load_format="dummy", device="cuda", dtype="bfloat16", cuda_graph_max_bs=max(batches),
        max_running_requests=max(batches), max_model_len=max(contexts) + 64, chunked_prefill_size=chunk,
        max_num_batched_tokens=chunk, rank=rank if world > 1 else None,
        dist_init_method=f"tcp://127.0.0.1:{port}" if world > 1 else None, dp_moe=args.dp_moe, **layout)
    fill_pool(runner.kv_pool, runner.cfg)
    ceil = measure_ceilings()
    g = get_parallel_state().world
    link = link_bandwidth(g) if g.size > 1 else {"allreduce_bus_bytes_per_s": float("inf")}
    sweep = latency_sweep(g) if g.size > 1 and args.latency_sweep else None
    result = {"config": args.config, "layout": args.layout, "rank": rank, "ceilings": ceil, "link": link,
              "latency_sweep": sweep,
              "manifest": {k: runner.manifest().get(k) for k in ("startup_time", "kv_pool", "cuda_graph", "parallel")},
              "decode": decode_rows(runner, ceil, link, layout, batches, contexts, sweep)}
    if prefill and (rank == 0 or not layout.get("enable_dp_attention")):
        result["prefill"] = bench_prefill(runner, ceil, prefill)
    elif prefill:  # DP-attention: rank 1 keeps the MoE exchanges of rank 0's prefills company
        for _ in prefill:
            for _ in range(4):
                runner.forward_idle()
    if prefill and layout.get("enable_dp_attention"):  # the deployment's prefill: every rank its share at once
        result["prefill_split"] = bench_prefill(runner, ceil, [n // g.size for n in prefill])
    Path(out, f"{args.config}-{args.layout}-rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="glm-5.3-slice")
    p.add_argument("--layout", default="tp2", choices=list(LAYOUTS))
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--prefill", default="8192,32768", help="comma-separated prompt lengths ('' for none)")
    p.add_argument("--latency-sweep", action=argparse.BooleanOptionalAction, default=True,
                   help="measure the per-collective latency inside a CUDA graph (multi-GPU layouts)")
    p.add_argument("--dp-moe", default="auto", choices=("auto", "gather", "a2a"),
                   help="DP-attention layouts: how each step's MoE layers meet (engine/dp_step.py)")
    args = p.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    lay = LAYOUTS[args.layout]
    world = max(lay.get("tensor_parallel_size", 1), lay.get("expert_parallel_size", 1))
    if world == 1:
        rank_main(0, 1, 0, args, args.out)
    else:
        mp.spawn(rank_main, args=(world, free_port(), args, args.out), nprocs=world, join=True)
    r0 = json.loads(Path(args.out, f"{args.config}-{args.layout}-rank0.json").read_text())
    for row in r0["decode"]:
        if "skipped" not in row:
            print(f"{args.config} {args.layout} bs={row['bs']:>3} ctx={row['ctx']:>5}: {row['step_ms']:.3f} ms, "
                  f"roofline {row['roofline_ms']:.3f} ({row['ratio']:.2f}x), comm measured "
                  f"{row['comm_measured_ms']:.3f} ms vs ledger {_vs(row, 'comm_ledger_ms')}, with measured latency "
                  f"{_vs(row, 'comm_ledger_calibrated_ms')}, + sweep bandwidth "
                  f"{_vs(row, 'comm_ledger_calibrated_bw_ms')}"
                  + (f" [dp {row['dp_step']['mode']} rows {row['dp_step']['rows']}"
                     f"{' graph' if row['dp_step']['graph'] else ''}]" if row.get("dp_step") else ""))
    for row in r0.get("prefill", []):
        print(f"{args.config} {args.layout} prefill {row['tokens']}: {row['seconds']:.3f} s ({row['ratio']:.2f}x)")
    for row in r0.get("prefill_split", []):
        print(f"{args.config} {args.layout} prefill {row['tokens']} on each rank at once: {row['seconds']:.3f} s")
    if r0.get("latency_sweep"):
        print_latency_hook(r0["latency_sweep"], world)


def _vs(row: dict, key: str) -> str:
    """A ledger time and measured / ledger."""
    v = row.get(key)
    return f"{v:.3f} ms ({row['comm_measured_ms'] / v:.2f}x)" if v else "-"


def print_latency_hook(sweep: dict, world: int) -> None:
    """The measured per-collective latency and the two lines of dsaserve/ledger/hardware.py to set from it."""
    kinds = ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in sweep["latency_s"].items())
    us = sweep["latency_s_mean"] * 1e6
    print(f"in-graph collective latency ({world} GPUs, {sweep['calls_per_graph']} calls per graph, 4 KiB-4 MiB): "
          f"{kinds}; mean {us:.1f} us; bandwidth at these sizes {sweep['bytes_per_s_mean'] / 1e9:.0f} GB/s per rank "
          "on the wire (dsaserve ledger --nvlink-gbs for decode-size planning; the preset keeps the datasheet's)")
    print("ledger hook, dsaserve/ledger/hardware.py:")
    print(f"H200_NVLINK_LATENCY_S = {us:.1f} * US")
    print(f'H200_NVLINK_LATENCY_SOURCE = "measured {datetime.date.today()}: bench/bench_multi_gpu.py latency sweep '
          f'on {world}xH200 NVLink, in-graph {kinds} (intercept of latency + wire / bandwidth), mean of the kinds"')


if __name__ == "__main__":
    main()
