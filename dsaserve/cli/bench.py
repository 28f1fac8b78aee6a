"""`dsaserve bench`: serving benchmarks (measurement, never part of the request path).

    dsaserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --input-len 512 --output-len 128 \\
        --request-rate 8 --max-concurrency 32
    dsaserve bench serve --base-url URL --dataset sharegpt-like --num-prompts 500 --max-concurrency 64
    dsaserve bench serve --base-url URL --first-request --input-len 1024 --output-len 64
    dsaserve bench step [args of bench/bench_scheduler_step.py]

Owns: the `bench` command line. `bench serve` lives in dsaserve.bench (datasets, client, metrics, report:
vLLM's `benchmark_serving` metrics, counted in tokens); `bench step` runs the engine's step script.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path

from dsaserve.common import envs

STEP_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_scheduler_step.py"
# DSASERVE_BENCH_STEP_SCRIPT (common/envs.py): another script path (tests, out-of-tree checkouts)


def register(subparsers: argparse._SubParsersAction) -> None:
    from dsaserve.bench.serve import add_arguments, main_serve
    from dsaserve.server.server_args import HelpFormatter  # a default only where it says something

    p = subparsers.add_parser("bench", help="benchmarks: `bench serve` (HTTP client), `bench step` (scheduler)")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    s = sub.add_parser("serve", help="benchmark a running OpenAI-compatible server", formatter_class=HelpFormatter)
    add_arguments(s)
    s.set_defaults(func=main_serve)
    # every argument (--help included) belongs to the script: no option prefix of our own here
    st = sub.add_parser("step", help="scheduler step overhead (runs bench/bench_scheduler_step.py)",
                        prefix_chars="+", add_help=False)
    st.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    st.set_defaults(func=main_step)
    p.set_defaults(func=lambda ns: (p.print_help(), 2)[1])


# ---- bench step ---------------------------------------------------------------------------------
def main_step(ns: argparse.Namespace) -> int:
    path = Path(envs.DSASERVE_BENCH_STEP_SCRIPT or STEP_SCRIPT)
    if not path.is_file():
        print(f"dsaserve bench step: {path} not found (the engine's scheduler-step benchmark)", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("bench_scheduler_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "main"):
        print(f"dsaserve bench step: {path} has no main()", file=sys.stderr)
        return 2
    if inspect.signature(module.main).parameters:  # main(argv)
        return int(module.main(list(ns.args)) or 0)
    saved, sys.argv = sys.argv, [str(path), *ns.args]  # main() parses sys.argv itself
    try:
        return int(module.main() or 0)
    finally:
        sys.argv = saved
