"""The host's work in a drafting step (engine/mtp.py, stage 7), with the model's forwards replaced by no-ops: what a
step with drafts adds on the CPU beside its kernels (on the slice, H100: the step's "rest" grew from
0.27 to 1.73 ms at 16 requests x 3 drafts, bench/RESULTS.md, thirty-sixth session).

The no-op runner answers every main row with token g(p + 1) for the token at position p, and the MTP layer at
position i with g(i + 2) (`--accept all`: every draft kept) or another token (`none`: every draft rejected), so the
bookkeeping of both paths is timed. Each part's median µs a step: schedule, build, the sampler (host side, a small
vocabulary), launched + resolve, the drafts' rows and kept drafts, the extend and chained MTP forwards' host work,
and the whole step.

    PYTHONPATH=. python bench/bench_draft_host.py [--batches 1,16,64] [--steps 1,3] [--accept all,none] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from types import SimpleNamespace

import torch

from bench.bench_scheduler_step import timed
from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.request import EngineRequest

VOCAB, HIDDEN, CONTEXT = 512, 8, 1000


def token_at(p: torch.Tensor) -> torch.Tensor:
    """The stub model's token at position p (every output is determined by its position)."""
    return (p * 7 + 3) % (VOCAB - 2) + 2


class NoopMTPRunner:
    """The ModelRunner interface a drafting EngineCore uses, with forwards that only write one-hot logits."""

    def __init__(self, num_pages: int, accept: bool):
        self.cfg = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20, eos_token_id=(1,))
        self.model = SimpleNamespace(with_mtp=True)
        self.num_pages, self.page_size, self.eos_token_ids, self.accept = num_pages, 64, (1,), accept
        self.device = "cpu"
        self.tokenizer, self.chat_template, self.startup_time, self.last_prompt_logprobs = None, None, {}, None
        self.dp_sync = None
        # the drafts' placeholders' values (engine/mtp.py): the no-op forwards read no ids, so nothing resolves them
        self.future_token_ids = torch.zeros(4096, dtype=torch.int64)

    @staticmethod
    def _one_hot(tokens: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(tokens.numel(), VOCAB)
        logits[torch.arange(tokens.numel()), tokens] = 1.0
        return logits

    def forward(self, batch):
        return self.forward_with_hidden(batch)[0]

    def forward_with_hidden(self, batch):
        pos = batch.positions[batch.logits_indices]
        return self._one_hot(token_at(pos + 1)), torch.zeros(batch.num_tokens, HIDDEN)

    def forward_mtp(self, batch, prev_hidden, drafts=None):
        pos = batch.positions[batch.logits_indices]
        guess = token_at(pos + 2) if self.accept else (token_at(pos + 2) + 1) % VOCAB
        return self._one_hot(guess), torch.zeros(pos.numel(), HIDDEN)


def make_core(batch: int, steps: int, accept: bool, max_tokens: int) -> EngineCore:
    pages = batch * -(-(CONTEXT + max_tokens + steps + 2) // 64) + 8
    args = EngineArgs(model="noop", max_running_requests=batch, num_pages=pages, max_num_batched_tokens=4096,
                      device="cpu", cuda_graph_max_bs=batch * (steps + 1), speculative_algorithm="mtp",
                      speculative_num_steps=steps)
    core = EngineCore(args, runner=NoopMTPRunner(pages, accept))
    for i in range(batch):
        core.add_request(EngineRequest(f"r{i}", [int(token_at(torch.tensor(j))) for j in range(CONTEXT)],
                                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    while any(r.num_pending > 1 for r in core.scheduler.running) or core.stats()["num_running"] < batch:
        core.step()  # the prompts, not measured
    for _ in range(4):
        core.step()
    return core


def bench(batch: int, steps: int, accept: bool, n: int, profile: bool) -> dict[str, float]:
    core = make_core(batch, steps, accept, max_tokens=(n + 8) * (steps + 1) + 16)
    parts = {k: [] for k in ("schedule", "build", "sample", "launched", "resolve", "rows", "kept", "extend",
                             "forward_mtp")}
    timed(core.scheduler, "schedule", parts["schedule"])
    timed(core.builder, "build", parts["build"])
    timed(core.sampler, "sample", parts["sample"])
    timed(core.scheduler, "launched", parts["launched"])
    timed(core.scheduler, "resolve", parts["resolve"])
    timed(core.mtp, "sample_rows", parts["rows"])
    timed(core.mtp, "kept", parts["kept"])
    timed(core.mtp, "extend", parts["extend"])
    timed(core.runner, "forward_mtp", parts["forward_mtp"])
    prof = cProfile.Profile() if profile else None
    step_ns, tokens0 = [], core.stats().get("spec_accepted_tokens", 0)
    for _ in range(n):
        t0 = time.perf_counter_ns()
        if prof:
            prof.enable()
        core.step()
        if prof:
            prof.disable()
        step_ns.append(time.perf_counter_ns() - t0)
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    kept = core.stats().get("spec_accepted_tokens", 0) - tokens0
    us = {k: sum(v) / n / 1e3 for k, v in parts.items()}  # a step's total of each (several calls a step)
    us["update"] = us.pop("launched") + us.pop("resolve")
    us["mtp_host"] = us["extend"] - us["forward_mtp"]  # the extend's own work, the no-op forwards taken out
    us["step"] = statistics.median(step_ns) / 1e3
    us["kept_per_step"] = kept / n
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", default="1,3")
    ap.add_argument("--accept", default="all,none")
    ap.add_argument("--n", type=int, default=100, help="measured steps")
    ap.add_argument("--profile", action="store_true", help="cProfile the measured steps (slower)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| batch | drafts | kept | schedule | build | sampler | update | draft rows + kept | MTP host work "
          "| step µs (median) |\n|" + "---|" * 10)
    for b in (int(x) for x in args.batches.split(",")):
        for k in (int(x) for x in args.steps.split(",")):
            for acc in args.accept.split(","):
                r = bench(b, k, acc == "all", args.n, args.profile)
                print(f"| {b} | {k} | {acc} ({r['kept_per_step']:.1f}/step) | {r['schedule']:.0f} | {r['build']:.0f} "
                      f"| {r['sample']:.0f} | {r['update']:.0f} | {r['rows'] + r['kept']:.0f} | {r['mtp_host']:.0f} "
                      f"| {r['step']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
