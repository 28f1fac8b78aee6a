"""Where a drafting engine's host time goes (engine/mtp.py; stage 7): cProfile over one timed `generate` of a
plain and a drafting engine, each warmed first, the functions by their own time and by cumulative time. A drafting
step waits for its verify's samples, so the host's time after that wait is what a step loses beside its kernels
(`bench_speculative.py --phases`: "rest").
    PYTHONPATH=. python bench/profile_spec_host.py --model glm-5.3-slice --load-format dummy --batch 16 --steps 3
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

from bench.bench_speculative import engine_for, engine_kwargs, token_prompts
from dsaserve import SamplingParams


def profile_engine(args, steps: int) -> str:
    prompts = token_prompts(args.batch)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with engine_for(args.model, steps, args.device, args.load_format, engine_kwargs(args.mem_fraction_static)) as eng:
        for _ in range(2):
            eng.generate(prompts, params)
        before = eng.core.stats()["steps"]
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        eng.generate(prompts, params)
        prof.disable()
        wall, n = time.perf_counter() - t0, eng.core.stats()["steps"] - before
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out)
    out.write(f"=== steps {steps}: {n} engine steps, {wall * 1e3 / max(n, 1):.3f} ms a step (profiled)\n")
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats(args.top)
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="glm-5.3-mini")
    ap.add_argument("--device", default=None)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", default="0,3", help="--speculative-num-steps values (0: plain)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("--mem-fraction-static", type=float, default=None)
    args = ap.parse_args()
    for steps in (int(s) for s in args.steps.split(",")):
        print(profile_engine(args, steps), flush=True)


if __name__ == "__main__":
    main()
