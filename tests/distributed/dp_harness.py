"""The DP-attention scenario on 2 gloo ranks: each rank runs its *own* requests (uneven counts), and at
some steps one rank has none and runs `forward_idle` while the other steps.

Requests 0 and 2 live on rank 0, request 1 on rank 1 (the prompts and slot bases of harness.py). Steps
(rank 0 | rank 1):
  prefill [0, 2]       | idle
  idle                 | prefill [1]
  decode j of [0, 2]   | decode j of [1]            for every j except IDLE_DECODE, where the two ranks
  decode j of [0, 2]   | idle                       take turns, as in the first two steps
  idle                 | decode j of [1]
  MTP over prompt 0 (main forward, then the MTP layer) | idle, idle (MTP layer)
The MTP step calls the model directly on both ranks (no step agreement: the exchange path); every other step
goes through the runner, which agrees on the step first (engine/dp_step.py): prefills take the all-to-all
exchange, decodes the padded all-gather / reduce-scatter path (an idle rank runs padding).
Each rank saves, per step, its logits (None when idle), its token count, the agreed step, its collective
counters and its graph replays.
"""

from __future__ import annotations

from pathlib import Path

import torch

from dsaserve.common.counters import COUNTERS
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import contiguous_batch
from tests.distributed.harness import BASES, _collective_delta, _mtp_logits, prompts_for

OWNED = ([0, 2], [1])  # rank -> requests
IDLE_DECODE = 1  # the decode step at which the ranks take turns idling


def _step(runner: ModelRunner, batch, log: list, what: tuple) -> None:
    """One step on this rank: a batch (logits at batch.logits_indices) or idle (batch None)."""
    before = COUNTERS.snapshot()
    if batch is None:
        runner.forward_idle()
        logits, tokens, what = None, 0, ("idle",)
    else:
        # clone: a replayed step's logits are the graph's output buffer, which the next replay overwrites
        logits, tokens = runner.forward(batch).clone(), batch.num_tokens
    replays = COUNTERS.diff(COUNTERS.snapshot(), before).get("graph_replays", 0)
    log.append({"what": what, "logits": logits, "tokens": tokens, "counters": _collective_delta(before),
                "dp_step": runner.dp_step, "graph_replays": replays})


def _prefill(prompts: list[list[int]], mine: list[int]):
    batch = contiguous_batch([prompts[r] for r in mine], [0] * len(mine), [BASES[r] for r in mine])
    batch.logits_indices = torch.arange(batch.num_tokens)
    return batch


def _decode(prompts, tokens, mine: list[int], j: int):
    return contiguous_batch([[tokens[r][j]] for r in mine], [len(prompts[r]) + j for r in mine],
                            [BASES[r] for r in mine])


def run_dp_scenario(runner: ModelRunner, rank: int, tokens: list[list[int]]) -> list[dict]:
    prompts, mine, log = prompts_for(runner.cfg), OWNED[rank], []
    for turn in (0, 1):
        _step(runner, _prefill(prompts, mine) if rank == turn else None, log, ("prefill",))
    for j in range(len(tokens[0])):
        turns = (0, 1) if j == IDLE_DECODE else (rank,)
        for turn in turns:
            _step(runner, _decode(prompts, tokens, mine, j) if rank == turn else None, log, ("decode", j))
    before = COUNTERS.snapshot()
    if rank == 0:
        mtp = _mtp_logits(runner, prompts[0])
    else:  # rank 0 calls the model itself (`_mtp_logits`): so does this rank, with no tokens
        runner.model.forward_idle()
        runner.forward_idle(mtp_layer=0)
        mtp = None
    log.append({"what": ("mtp",) if rank == 0 else ("idle",), "logits": mtp, "tokens": None,
                "counters": _collective_delta(before)})
    return log


def _prefill_rows(cfg, reqs: list[int]) -> torch.Tensor:
    """Row indices of the reference prefill (3 prompts back to back) that belong to `reqs`, in their order."""
    lens = [len(p) for p in prompts_for(cfg)]
    starts = [sum(lens[:r]) for r in range(len(lens))]
    return torch.cat([torch.arange(starts[r], starts[r] + lens[r]) for r in reqs])


def expected_logits(ref: dict, cfg, rank: int, what: tuple) -> torch.Tensor:
    """What the single-rank reference computed for this rank's requests at the step `what`."""
    if what[0] == "prefill":
        return ref["logits"][0][_prefill_rows(cfg, OWNED[rank])]
    if what[0] == "decode":
        return ref["logits"][1 + what[1]][OWNED[rank]]
    return ref["mtp_logits"]


def dp_worker(rank: int, init_method: str, refs: dict, out_dir: str, runner_kw: dict) -> None:
    results: dict = {}
    for name in refs:
        runner = ModelRunner.from_kwargs(name, kv_layout="fp32", load_mtp=True, dist_init_method=init_method,
                                         expert_parallel_size=2, enable_dp_attention=True, **runner_kw)
        results[name] = {"steps": run_dp_scenario(runner, rank, refs[name]),
                         "parallel": runner.manifest()["parallel"], "not_loaded": runner.load_report.not_loaded}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
