"""Speculative decoding with the MTP layer (engine/mtp.py) against plain decoding, same engine settings, same run:
greedy outputs compared token for token, the drafts kept, tokens a step, and the decode wall time of each.

The built-in glm-5.3-mini is the model with a trained MTP layer (its held-out MTP top-1 accuracy is 0.59,
train_report.json); a random-weight config drafts at chance and measures only the machinery's cost. On the CPU
the reference path is compute-bound, so two tokens a verify step cost about two steps: the wall time there is the
machinery's overhead, not the speedup a memory-bound GPU step would give.

    PYTHONPATH=. python bench/bench_speculative.py [--model glm-5.3-mini] [--device cpu] [--batch 1,8]
        [--max-tokens 64] [--load-format dummy]

`--model glm-5.3-slice --load-format dummy` times the machinery at a real layer's size (random weights: drafts at
chance). Each line also gives how the drafting engine's forwards ran: verify steps replayed in the decode graphs,
MTP forwards in theirs (engine/mtp_graphs.py) or eagerly.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time
from collections.abc import Iterator

import torch

from dsaserve import Engine, SamplingParams
from dsaserve.common.counters import COUNTERS
from dsaserve.weights.tokenizer_builder import CORPUS

PROMPTS = [line.strip() for line in CORPUS.splitlines() if len(line.strip()) > 40]


def run(model: str, device: str | None, steps: int, prompts: list[str], max_tokens: int,
        repeat: int = 1, load_format: str = "auto", phases: bool = False, engine_kw: dict | None = None
        ) -> tuple[list, float, dict]:
    """(outputs, decode seconds, engine stats) of one engine (steps 0: no drafts) over the prompts, warmed once; with
    `repeat` > 1 the last of that many runs (whatever the warmup left to compile is done by then). The engine is
    closed and its memory given back before this returns (the next engine's memory profile sizes its pool from
    what is free)."""
    with engine_for(model, steps, device, load_format, engine_kw) as eng:
        return _timed_runs(eng, prompts, max_tokens, repeat, phases)


def token_prompts(batch: int) -> list[list[int]]:
    """`batch` prompts of 48 token ids (random weights have no tokenizer), one distinct sequence a request."""
    return [[10 + (7919 * (r + 1) * (j + 1)) % 500 for j in range(48)] for r in range(batch)]


def engine_kwargs(mem_fraction_static: float | None) -> dict:
    """The engines' extra arguments from the command line (`--mem-fraction-static`)."""
    return {} if mem_fraction_static is None else {"mem_fraction_static": mem_fraction_static}


@contextlib.contextmanager
def engine_for(model: str, steps: int, device: str | None, load_format: str = "auto",
               engine_kw: dict | None = None) -> Iterator[Engine]:
    """An engine drafting `steps` tokens a request (0: plain decoding), closed and its memory given back on exit:
    the next engine's memory profile sizes its KV pool from what is free."""
    spec = {"speculative_algorithm": "mtp", "speculative_num_steps": steps} if steps else {}
    eng = Engine(model, device=device, load_format=load_format, **spec, **(engine_kw or {}))
    try:
        yield eng
    finally:
        eng.close()
        del eng
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _timed_runs(eng: Engine, prompts: list, max_tokens: int, repeat: int, phases: bool) -> tuple[list, float, dict]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    eng.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # first-use work
    for _ in range(repeat - 1):
        eng.generate(prompts, params)
    before, counts = eng.core.stats(), COUNTERS.snapshot()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params)
    seconds = time.perf_counter() - t0
    after, counts = eng.core.stats(), COUNTERS.diff(COUNTERS.snapshot(), counts)
    diff = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], int | float)}
    diff["forwards"] = {k: int(v) for k, v in counts.items()
                        if k in ("graph_replays", "mtp_graph_replays", "piecewise_replays")
                        or k.startswith(("eager_fallbacks", "mtp_eager"))}
    was, now = before.get("spec_accepted_per_pos", []), after.get("spec_accepted_per_pos", [])
    diff["per_pos"] = [n - (was[j] if j < len(was) else 0) for j, n in enumerate(now)]
    if phases:  # a run of its own after the timed one (its waits slow the step)
        timer = PhaseTimes(eng)
        eng.generate(prompts, params)
        diff["phases"] = timer.line(eng.core.stats()["steps"] - after["steps"])
    return outs, seconds, diff


class PhaseTimes:
    """--phases: each part of a step timed with the device synchronized around it (the waits change the step a
    little; the split is what it is for): the forward (a drafting engine's verifies its drafts), the sampler, the
    MTP forwards (extend and chained), and the rest (scheduling, batch building, the kept drafts' bookkeeping)."""

    PARTS = (("forward", "runner", "forward"), ("forward", "runner", "forward_with_hidden"),
             ("sample", "sampler", "sample_async"),  # `sample` is sample_async's, waited for
             ("mtp_forwards", "runner", "forward_mtp"))

    def __init__(self, eng: Engine):
        self.sync = torch.cuda.synchronize if eng.core.runner.device.type == "cuda" else (lambda: None)
        self.total: dict[str, float] = {"step": 0.0}
        core = eng.core
        for name, owner, attr in self.PARTS:
            obj = getattr(core, owner)
            setattr(obj, attr, self._timed(name, getattr(obj, attr)))
        core.step = self._timed("step", core.step)

    def _timed(self, name: str, fn):
        self.total.setdefault(name, 0.0)

        def timed(*a, **kw):
            self.sync()
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            self.sync()
            self.total[name] += time.perf_counter() - t0
            return out
        return timed

    def line(self, steps: int) -> str:
        ms = {k: 1e3 * v / max(steps, 1) for k, v in self.total.items()}
        parts = {n: ms[n] for n, _, _ in self.PARTS}  # a name twice: one entry
        rest = ms["step"] - sum(parts.values())
        return " | ".join(f"{n} {v:.3f}" for n, v in parts.items()) + f" | rest {rest:.3f} | step {ms['step']:.3f} ms"


def position_rates(stats: dict) -> str:
    """Each position's kept drafts over the request-steps that verified drafts, and in brackets over the position
    before's (the chance a draft is kept when the one before it was: the ledger's --draft-acceptance)."""
    steps, per, out, prev = stats.get("spec_num_drafts", 0), stats.get("per_pos", []), [], None
    for n in per:
        rate = n / max(steps, 1)
        out.append(f"{rate:.2f}" + (f" ({rate / prev:.2f})" if prev else ""))
        prev = rate
    return ", ".join(out) or "none kept"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="glm-5.3-mini")
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", default="1,3", help="--speculative-num-steps values to run")
    ap.add_argument("--repeat", type=int, default=1, help="time the last of this many runs of each engine")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights (a config without a checkpoint)")
    ap.add_argument("--phases", action="store_true", help="one more run of each engine, its step split in parts")
    ap.add_argument("--mem-fraction-static", type=float, default=None,
                    help="the engines' --mem-fraction-static (one engine at a time holds the GPU)")
    args = ap.parse_args()
    engine_kw = engine_kwargs(args.mem_fraction_static)
    for bs in (int(b) for b in args.batch.split(",")):
        prompts = PROMPTS[:bs] if args.load_format != "dummy" else token_prompts(bs)
        base, t_base, s_base = run(args.model, args.device, 0, prompts, args.max_tokens, args.repeat, args.load_format,
                                   args.phases, engine_kw)
        tokens = bs * args.max_tokens
        print(f"batch {bs:3d}: plain {s_base['steps']} steps {t_base:.3f} s ({tokens / t_base:.1f} tok/s)")
        if "phases" in s_base:
            print(f"    synchronized parts a step: {s_base['phases']}")
        for steps in (int(s) for s in args.steps.split(",")):
            spec, t_spec, s_spec = run(args.model, args.device, steps, prompts, args.max_tokens, args.repeat,
                                       args.load_format, args.phases, engine_kw)
            same = sum(b.token_ids == s.token_ids for b, s in zip(base, spec, strict=True))
            drafts, kept = s_spec.get("spec_draft_tokens", 0), s_spec.get("spec_accepted_tokens", 0)
            print(f"  mtp x{steps}: {s_spec['steps']} steps {t_spec:.3f} s ({tokens / t_spec:.1f} tok/s), drafts kept "
                  f"{kept}/{drafts} ({kept / max(drafts, 1):.2f}), tokens a step a request "
                  f"{tokens / max(s_spec['steps'], 1) / bs:.2f} | mtp / plain time {t_spec / t_base:.2f} | greedy "
                  f"outputs equal {same}/{bs}")
            print(f"    kept by position / request-steps: {position_rates(s_spec)} | forwards {s_spec['forwards']}")
            if "phases" in s_spec:
                print(f"    synchronized parts a step: {s_spec['phases']}")


if __name__ == "__main__":
    main()
