"""Several GPUs (issue: "Several GPUs measured"): decode steps and prefills of one layout per run, every rank a
process of its own over NCCL, each number beside its roofline and the ledger, all from the same run.

    PYTHONPATH=. python bench/bench_multi_gpu.py --out DIR --config glm-5.3-slice --layout tp2
    layouts: tp1, tp2, ep2 (replicated attention + EP2), tp2ep2, dp2ep2 (DP-attention + EP2)

Per GPU: the bytes a step must read (weights the rank holds and touches + the KV and indexer rows its own
requests read; bench_gpu.decode_bytes) over the copy bandwidth measured on that GPU, plus the bytes the rank
puts on NVLink (the counting wrapper's `collective_wire_bytes`) over the all-reduce bus bandwidth measured in
the same run. Communication is measured by replaying the step's counted collectives (same kinds, calls and
message sizes) on their own, and set beside the ledger's `step_plan` time for the same deployment. Under
DP-attention a deployment batch of B is split over the ranks (B=1: rank 1 runs the idle step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
from bench_gpu import bench_prefill, cuda_time, decode_bytes, fill_pool, measure_ceilings  # noqa: E402

from dsaserve.common.counters import COUNTERS  # noqa: E402
from dsaserve.common.wire import free_port  # noqa: E402
from dsaserve.distributed import collectives  # noqa: E402
from dsaserve.distributed.parallel_state import get_parallel_state  # noqa: E402
from dsaserve.engine.memory_profile import dummy_decode  # noqa: E402
from dsaserve.engine.model_runner import ModelRunner  # noqa: E402
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
    run()  # NCCL's first call of a shape sets up its channels: not inside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # replayed as the decode graphs run them: no per-call host launch
    with torch.cuda.graph(graph):
        run()
    return cuda_time(graph.replay, iters=10, warmup=2)


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


def ledger_comm_s(cfg, layout: dict, tokens: int) -> float:
    from dsaserve.ledger.collective_plan import row_time, step_plan
    from dsaserve.ledger.deployment import Assumptions, Deployment
    from dsaserve.ledger.hardware import get_hardware

    tp, ep = layout.get("tensor_parallel_size", 1), layout.get("expert_parallel_size", 1)
    dp = layout.get("enable_dp_attention", False)
    if max(tp, ep) == 1:
        return 0.0
    dep = Deployment(tp=tp, ep=ep, dp_attention=dp)
    asm = Assumptions(dp_moe="a2a") if dp else Assumptions()
    return sum(row_time(r, get_hardware("h200"), asm) for r in step_plan(cfg, dep, asm, tokens, tokens))


def local_batch(bs: int, state) -> int:
    if not state.dp_attention:
        return bs
    share = -(-bs // state.world_size)
    return max(0, min(share, bs - state.rank * share))


def decode_rows(runner, ceil, link, layout, batches, contexts) -> list[dict]:
    state, g = get_parallel_state(), get_parallel_state().world
    rows = []
    for ctx in contexts:
        for bs in batches:
            mine = local_batch(bs, state)
            pages = -(-(ctx + 1) // runner.page_size)
            if max(mine, 1) * pages > runner.num_pages:
                rows.append({"bs": bs, "ctx": ctx, "skipped": "pool too small"})
                continue
            batch = dummy_decode(mine, ctx, runner.page_size, "cpu") if mine else None
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
            rows.append({"bs": bs, "ctx": ctx, "local_bs": mine, "step_ms": t * 1e3, "hbm_ms": hbm_s * 1e3,
                         "link_ms": link_s * 1e3, "roofline_ms": (hbm_s + link_s) * 1e3,
                         "ratio": t / (hbm_s + link_s) if hbm_s + link_s else None,
                         "tokens_per_s": bs / t, "collectives": delta, "comm_measured_ms": comm * 1e3,
                         "comm_ledger_ms": ledger_comm_s(runner.cfg, layout, bs) * 1e3})
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
        dist_init_method=f"tcp://127.0.0.1:{port}" if world > 1 else None, **layout)
    fill_pool(runner.kv_pool, runner.cfg)
    ceil = measure_ceilings()
    g = get_parallel_state().world
    link = link_bandwidth(g) if g.size > 1 else {"allreduce_bus_bytes_per_s": float("inf")}
    result = {"config": args.config, "layout": args.layout, "rank": rank, "ceilings": ceil, "link": link,
              "manifest": {k: runner.manifest().get(k) for k in ("startup_time", "kv_pool", "cuda_graph", "parallel")},
              "decode": decode_rows(runner, ceil, link, layout, batches, contexts)}
    if prefill and (rank == 0 or not layout.get("enable_dp_attention")):
        result["prefill"] = bench_prefill(runner, ceil, prefill)
    elif prefill:  # DP-attention: rank 1 keeps the MoE exchanges of rank 0's prefills company
        for _ in prefill:
            for _ in range(4):
                runner.forward_idle()
    Path(out, f"{args.config}-{args.layout}-rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--config", default="glm-5.3-slice")
    p.add_argument("--layout", default="tp2", choices=list(LAYOUTS))
    p.add_argument("--batches", default="1,8,32,128")
    p.add_argument("--contexts", default="1024,8192")
    p.add_argument("--prefill", default="8192,32768", help="comma-separated prompt lengths ('' for none)")
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
                  f"{row['comm_measured_ms']:.3f} vs ledger {row['comm_ledger_ms']:.3f} ms")
    for row in r0.get("prefill", []):
        print(f"{args.config} {args.layout} prefill {row['tokens']}: {row['seconds']:.3f} s ({row['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
