"""Scheduler + batch-building overhead per decode step, with the model forward replaced by a no-op, and the
step loop with overlap scheduling on against off (issue 16).

Note 001 ("每步的 Python 预算"): the CPU side of a step — schedule, page bookkeeping, building the batch,
turning samples into per-request deltas — must stay below the GPU time of the step or the GPU idles.
This measures that CPU time at decode batch 1, 64 and 256 on steady decoding requests (context ~1K
tokens, so a request crosses a page boundary — allocation + prefix-cache registration — every 64
steps). The sampler is timed separately (greedy argmax on the host over a small vocabulary: on the GPU
it is a kernel, not Python), so `cpu total` = schedule + build + update (`Scheduler.launched` +
`Scheduler.resolve`) is the number to hold against the forward time.

    /work/venv/bin/python bench/bench_scheduler_step.py [--steps 256] [--append-results]
    python3 bench/bench_scheduler_step.py --model glm-5.3-tiny --device cuda   # + the real forward, timed

With `--model`, the same decode batches also run through the real ModelRunner (CUDA graphs up to the
largest batch), synchronously and overlapped (engine/overlap.py: step N+1 scheduled and launched while step
N runs), so the CPU overhead can be read against the step it has to hide behind, and the overlap's gain is
the ratio of the two whole-step times. On the no-op runner nothing runs asynchronously: both modes must
cost the same (`--overlap off,on` shows them side by side).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.engine.engine_core import EngineCore
from dsaserve.engine.request import EngineRequest

VOCAB = 512  # host-side greedy sampling stand-in; the real vocabulary (154880) is sampled on the GPU
CONTEXT = 1000


class NoopRunner:
    """The ModelRunner interface with a forward that returns preallocated logits."""

    def __init__(self, num_pages: int):
        self.cfg = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=1 << 20, eos_token_id=(1,))
        self.num_pages, self.page_size, self.eos_token_ids = num_pages, 64, (1,)
        self.device = "cpu"  # EngineCore's DeviceTimer: nothing runs on a device here
        self.tokenizer, self.chat_template, self.startup_time = None, None, {}
        self._logits = torch.zeros(1024, VOCAB)
        self.future_token_ids = torch.zeros(1024, dtype=torch.int64)  # overlap: placeholders are never read here

    def forward(self, batch):
        return self._logits[: batch.logits_indices.shape[0]]


def timed(obj, name: str, sink: list[int]) -> None:
    fn = getattr(obj, name)

    def wrapper(*a, **k):
        t0 = time.perf_counter_ns()
        r = fn(*a, **k)
        sink.append(time.perf_counter_ns() - t0)
        return r

    setattr(obj, name, wrapper)


def bench(batch: int, steps: int, model: str | None = None, device: str = "cpu", overlap: bool = False
          ) -> dict[str, float]:
    max_tokens = steps + 1024  # early requests decode while the later ones prefill (mixed steps)
    pages_per_req = -(-(CONTEXT + max_tokens) // 64)
    num_pages = batch * pages_per_req + 8
    args = EngineArgs(model=model or "noop", max_running_requests=max(batch, 1), num_pages=num_pages,
                      max_num_batched_tokens=max(4096, batch), device=device, cuda_graph_max_bs=max(batch, 1),
                      disable_overlap_schedule=not overlap)
    core = EngineCore(args, runner=None if model else NoopRunner(num_pages))
    assert core.overlap is overlap
    vocab = core.cfg.vocab_size
    for i in range(batch):
        core.add_request(EngineRequest(f"r{i}", [(7 * i + j) % (vocab - 2) + 2 for j in range(CONTEXT)],
                                       SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
    while core.stats()["num_running"] < batch or any(r.num_pending > 1 for r in core.scheduler.running):
        core.step()  # prefill, not measured
    for _ in range(8):
        core.step()  # warm
    t = {k: [] for k in ("schedule", "build", "forward", "sample", "launched", "resolve")}
    timed(core.scheduler, "schedule", t["schedule"])
    timed(core.builder, "build", t["build"])
    timed(core.runner, "forward", t["forward"])  # asynchronous on a GPU: the wait shows up in `resolve`'s caller
    timed(core.sampler, "sample_async", t["sample"])
    timed(core.scheduler, "launched", t["launched"])
    timed(core.scheduler, "resolve", t["resolve"])
    step_ns = []
    for _ in range(steps):
        t0 = time.perf_counter_ns()
        core.step()
        step_ns.append(time.perf_counter_ns() - t0)
    if device == "cuda":
        torch.cuda.synchronize()
    assert core.stats()["num_running"] == batch and core.stats()["preemptions"] == 0, core.stats()
    us = {k: statistics.median(v) / 1e3 for k, v in t.items()}
    us["update"] = us.pop("launched") + us.pop("resolve")
    us["cpu_total"] = us["schedule"] + us["build"] + us["update"]
    us["step"] = statistics.median(step_ns) / 1e3
    us["step_mean"] = statistics.mean(step_ns) / 1e3
    return us


def table(rows: dict[tuple[int, bool], dict[str, float]]) -> str:
    head = ("| batch | overlap | schedule µs | build batch µs | update µs | **cpu total µs** | per request µs "
            "| sampler µs (host, V=512) | whole step µs (median / mean) |")
    lines = [head, "|" + "---|" * 9]
    for (b, ov), r in rows.items():
        lines.append(f"| {b} | {'on' if ov else 'off'} | {r['schedule']:.0f} | {r['build']:.0f} | {r['update']:.0f} "
                     f"| **{r['cpu_total']:.0f}** | {r['cpu_total'] / b:.2f} | {r['sample']:.0f} "
                     f"| {r['step']:.0f} / {r['step_mean']:.0f} |")
    return "\n".join(lines)


def device_table(rows: dict[tuple[int, bool], dict[str, float]], model: str, device: str) -> str:
    """Per batch: the synchronous step, the overlapped one, and the gain (sync / overlap whole-step mean)."""
    lines = [f"| batch | cpu total µs | whole step µs, overlap off (median / mean) | overlap on (median / mean) "
             f"| tokens/s off | tokens/s on | gain | ({model} on {device}) |", "|" + "---|" * 8]
    for b in sorted({b for b, _ in rows}):
        off, on = rows.get((b, False)), rows.get((b, True))
        if off is None or on is None:
            continue
        lines.append(f"| {b} | {off['cpu_total']:.0f} | {off['step']:.0f} / {off['step_mean']:.0f} "
                     f"| {on['step']:.0f} / {on['step_mean']:.0f} | {b * 1e6 / off['step_mean']:.0f} "
                     f"| {b * 1e6 / on['step_mean']:.0f} | {off['step_mean'] / on['step_mean']:.2f}x | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=256, help="measured decode steps per batch size")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--append-results", action="store_true", help="append the table to bench/RESULTS.md")
    ap.add_argument("--model", default=None, help="also run the real model (built-in name or checkpoint dir)")
    ap.add_argument("--device", default="cuda", help="device of the --model run")
    ap.add_argument("--overlap", default="off,on", help="overlap scheduling modes to run: off, on or off,on")
    args = ap.parse_args()
    torch.set_num_threads(1)
    batches = [int(x) for x in args.batches.split(",")]
    modes = [m.strip() == "on" for m in args.overlap.split(",")]
    rows = {(b, ov): bench(b, args.steps, overlap=ov) for b in batches for ov in modes}
    out = table(rows)
    if args.model:
        real = {(b, ov): bench(b, args.steps, args.model, args.device, ov) for b in batches for ov in modes}
        out += "\n\nWith the real forward:\n\n" + table(real)
        out += "\n\nOverlap scheduling, whole step:\n\n" + device_table(real, args.model, args.device)
    print(out)
    if args.append_results:
        cpu = platform.processor() or platform.machine()
        note = (f"\n## bench_scheduler_step: scheduler + batch-building overhead per decode step\n\n"
                f"`python bench/bench_scheduler_step.py --steps {args.steps}` on {time.strftime('%Y-%m-%d')}, "
                f"{cpu}, Python {platform.python_version()}, torch {torch.__version__}, 1 torch thread; "
                f"forward = no-op, context {CONTEXT} tokens, greedy, prefix caching on; medians over "
                f"{args.steps} steps (a request crosses a page boundary every 64).\n\n{out}\n")
        path = Path(__file__).with_name("RESULTS.md")
        with path.open("a") as f:
            f.write(note)
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
