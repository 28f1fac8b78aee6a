"""`dsaserve` command line: one subcommand per module in this package.

Each module defines `register(subparsers)` (adds its parser and sets `func`). Modules are imported
lazily by name so `dsaserve ledger` never imports torch and `dsaserve --help` stays fast. `FIRST_LINE` is
the wall-clock time this module began, taken before any other import: `dsaserve serve`'s startup
manifest counts from the process's creation, through here, to the first 200 of /health
(server/startup_clock.py).
"""

# ruff: noqa: E402 -- the clock is read before any import, so that imports are counted too
from __future__ import annotations

import time

FIRST_LINE = time.time()

import argparse
import importlib
import sys

# subcommand -> module under dsaserve.cli, one line of help
SUBCOMMANDS = {
    "make-checkpoint": ("make_checkpoint", "write a random-weight checkpoint in the real HF FP8 layout"),
    "generate": ("generate", "generate from one prompt (offline engine)"),
    "serve": ("serve", "serve a model behind an OpenAI-compatible HTTP API"),
    "bench": ("bench", "benchmarks: `bench serve` (HTTP client), `bench step` (scheduler overhead)"),
    "eval": ("eval", "held-out perplexity and greedy agreement between numerics settings (KV layout, sparse, ...)"),
    "ledger": ("ledger", "predict every byte, FLOP and collective of a step; --reconcile against a run"),
}


def main(argv: list[str] | None = None) -> int:
    from dsaserve.common import bytecode_cache

    bytecode_cache.enable()  # before the heavy imports: where their bytecode is read and written
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="dsaserve", description="DSA-MoE inference engine and cost ledger")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    for name, (module, help_) in SUBCOMMANDS.items():
        if name == wanted:
            importlib.import_module(f"dsaserve.cli.{module}").register(sub)
        else:
            sub.add_parser(name, help=help_)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
