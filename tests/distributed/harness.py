"""Run a function on N gloo ranks on the CPU (torch.multiprocessing spawn), and the 2-rank scenario the
distributed tests assert on.

Ranks rendezvous over tcp://127.0.0.1:<free port>; each rank joins through ModelRunner's own startup path
(RANK / WORLD_SIZE in the environment + `dist_init_method`). A rank writes what it saw to
`<out_dir>/rank<r>.pt`; the parent process compares it with the single-rank model it ran itself.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsaserve.common.counters import COUNTERS
from dsaserve.distributed import collectives
from dsaserve.distributed.parallel_state import get_parallel_state, reset_parallel_state
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import contiguous_batch

CONFIGS = ("glm-5.3-tiny", "deepseek-v3.2-tiny")
MODES = {  # name -> ModelRunner parallel arguments
    "tp2": {"tensor_parallel_size": 2},
    "ep2": {"expert_parallel_size": 2},
    "tp2_ep2": {"tensor_parallel_size": 2, "expert_parallel_size": 2},
    "ep2_a2a": {"expert_parallel_size": 2, "moe_a2a": True},
    "tp2_ep2_a2a": {"tensor_parallel_size": 2, "expert_parallel_size": 2, "moe_a2a": True},
}
BASES = [0, 4 * 64, 8 * 64]  # page-aligned, disjoint slot ranges of the three requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, nprocs: int, *args) -> None:
    """fn(rank, init_method, *args) on `nprocs` CPU ranks; raises if any rank fails."""
    mp.spawn(_entry, args=(nprocs, f"tcp://127.0.0.1:{free_port()}", fn, args), nprocs=nprocs, join=True)


def _entry(rank: int, world: int, init_method: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)  # CI: 2 cores, 2 ranks
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    try:
        fn(rank, init_method, *args)
    finally:
        reset_parallel_state()
        if dist.is_initialized():
            dist.destroy_process_group()


def prompts_for(cfg) -> list[list[int]]:
    """Three prompts of >= 4 x index_topk tokens, so the indexer's top-k really drops keys."""
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist()
            for n in (4 * cfg.index_topk, 4 * cfg.index_topk + 9, 5 * cfg.index_topk + 3)]


def _collective_delta(before: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in COUNTERS.diff(COUNTERS.snapshot(), before).items() if k.startswith("collective")}


def run_scenario(runner: ModelRunner, decode_tokens: list[list[int]]) -> dict:
    """Prefill (logits at every position) + teacher-forced decode steps; logits and per-step collectives."""
    prompts = prompts_for(runner.cfg)
    batch = contiguous_batch(prompts, [0] * len(prompts), BASES)
    batch.logits_indices = torch.arange(batch.num_tokens)
    before = COUNTERS.snapshot()
    logits = [runner.forward(batch)]
    prefill = _collective_delta(before)
    decode = []
    for step in range(len(decode_tokens[0])):
        batch = contiguous_batch([[toks[step]] for toks in decode_tokens], [len(p) + step for p in prompts], BASES)
        before = COUNTERS.snapshot()
        logits.append(runner.forward(batch).clone())  # a replayed step's logits are the graph's output buffer
        decode.append(_collective_delta(before))
    # one token over 2 ranks: the a2a modes leave rank 1 an empty token chunk (the GPU ZeroDivisionError case);
    # it rewrites request 0's first decode slot with the same token, so later reads are unchanged
    single = runner.forward(contiguous_batch([[decode_tokens[0][0]]], [len(prompts[0])], BASES[:1]))
    return {"logits": logits, "prefill": prefill, "decode": decode, "mtp_logits": _mtp_logits(runner, prompts[0]),
            "single_token": single}


def _mtp_logits(runner: ModelRunner, prompt: list[int]) -> torch.Tensor:
    """The MTP layer over one prompt (fresh slots past the scenario's), logits at every position."""
    base = [12 * 64]
    _, hidden = runner.model(contiguous_batch([prompt], [0], base).to(runner.device), runner.kv_pool)
    batch = contiguous_batch([prompt[1:]], [0], base)
    batch.logits_indices = torch.arange(len(prompt) - 1)
    return runner.model.forward_mtp(batch.to(runner.device), runner.kv_pool, hidden[:-1])


def reference(name: str, n_decode: int, **runner_kw) -> tuple[dict, list[list[int]]]:
    """The single-rank model: its scenario with its own greedy tokens as the decode inputs."""
    runner = ModelRunner.from_kwargs(name, kv_layout="fp32", load_mtp=True, **runner_kw)
    prompts = prompts_for(runner.cfg)
    batch = contiguous_batch(prompts, [0] * len(prompts), BASES)
    last = runner.forward(batch)
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in range(n_decode):
        for r, toks in enumerate(tokens):
            toks.append(int(last[r].argmax()))
        batch = contiguous_batch([[t[-1]] for t in tokens], [len(p) + step for p in prompts], BASES)
        last = runner.forward(batch)
    # the scenario rewrites exactly the slots the greedy run wrote, with the same tokens: reuse the runner
    return run_scenario(runner, tokens), tokens


def run_ranks(worker_fn, n_decode: int, out: Path, configs: tuple[str, ...] = CONFIGS,
              **runner_kw) -> tuple[dict, list[dict]]:
    """The single-rank references of `configs`, then `worker_fn` on 2 ranks (ModelRunner keywords runner_kw for
    both, e.g. device="cuda"): (refs, what each rank saved)."""
    refs, tokens = {}, {}
    for name in configs:
        refs[name], tokens[name] = reference(name, n_decode, **runner_kw)
    spawn(worker_fn, 2, tokens, str(out), runner_kw)
    return refs, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def _collectives_probe(rank: int) -> dict:
    """Every wrapper once with known inputs: values and the counters they leave."""
    g = get_parallel_state().world
    before = COUNTERS.snapshot()
    x = torch.arange(12.0).view(3, 4) + 100 * rank
    out = {
        "all_reduce": collectives.all_reduce(x.clone(), g),
        "all_gather_dim1": collectives.all_gather(x, g, dim=1),
        "reduce_scatter_dim1": collectives.reduce_scatter(x, g, dim=1),
        # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3 rows to rank 0 and 0 to itself
        "all_to_all": collectives.all_to_all(x, [1, 3] if rank == 0 else [2, 0], [1, 2] if rank == 0 else [3, 0], g),
        "broadcast": collectives.broadcast(x.clone(), 1, g),
    }
    out["counters"] = _collective_delta(before)
    buf = torch.full((3, 8), -1.0)  # the gather into a given buffer (the CUDA graphs' logits): after the count
    out["all_gather_into"] = (collectives.all_gather(x, g, dim=1, out=buf) is buf, buf)
    return out


def worker(rank: int, init_method: str, refs: dict, out_dir: str, runner_kw: dict) -> None:
    results: dict = {}
    for name in refs:
        for mode, kwargs in MODES.items():
            runner = ModelRunner.from_kwargs(name, kv_layout="fp32", load_mtp=True, dist_init_method=init_method,
                                             **kwargs, **runner_kw)
            res = run_scenario(runner, refs[name])
            res["not_loaded"] = runner.load_report.not_loaded
            res["bytes_loaded"] = runner.load_report.bytes_loaded
            res["manifest_parallel"] = runner.manifest()["parallel"]
            results[f"{name}/{mode}"] = res
    results["probe"] = _collectives_probe(rank)
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
