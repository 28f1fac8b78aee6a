"""The sampler's extra time per decode step with a structured-output grammar active, at batch 1 and 64.

Every row decodes under its own JSON-schema grammar (xgrammar matcher; restarted when it completes): the
step's extra time is `fill` (xgrammar writes each row's token bitmask on the CPU) + `apply` (the bitmask
unpacked and the logits masked with torch ops, on the logits' device) + `accept` (each matcher takes its
token). It is measured against the same sampler step without grammars, on the same logits.

    /work/venv/bin/python bench/bench_grammar_sampler.py [--steps 200] [--device cpu|cuda] [--append-results]

The built-in tokenizer has 512 tokens, the model vocabulary is `--vocab` (default GLM-5's 154880): the
bitmask and the masked logits have the full vocabulary's size, while xgrammar's fill walks a 512-token
vocabulary, so on a real 150K tokenizer `fill` is larger (xgrammar reports tens of µs per row for JSON).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.config import load_config
from dsaserve.engine.grammar import GrammarCompiler, make_spec
from dsaserve.model.sampler import Sampler
from dsaserve.weights.tokenizer_builder import build_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}}},
          "required": ["name", "age"]}


class Row:
    prompt_token_ids = [0]
    suppressed_token_ids = ()

    def __init__(self, grammar):
        self.sampling, self.generator, self.grammar, self.out = SamplingParams(temperature=1.0), None, grammar, []

    @property
    def output_token_ids(self):
        return self.out


def run(batch: int, steps: int, vocab: int, device: str, compiler: GrammarCompiler, compiled, spec) -> dict:
    sampler = Sampler(seed=0)
    logits = [torch.randn(batch, vocab, device=device) for _ in range(8)]
    plain = [Row(None) for _ in range(batch)]
    constrained = [Row(compiler.state(compiled, spec)) for _ in range(batch)]
    out = {}
    for name, rows in (("plain", plain), ("grammar", constrained)):
        times = []
        for s in range(steps):
            for r in rows:
                if r.grammar is not None and r.grammar.terminated:
                    r.grammar.matcher.reset()
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            sampler.sample(logits[s % 8], rows)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter_ns() - t0)
        out[name] = statistics.median(times[steps // 10:]) / 1e3
    out["extra"] = out["grammar"] - out["plain"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--vocab", type=int, default=154880, help="model vocabulary (logits / bitmask width)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--append-results", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args()
    torch.set_num_threads(1)
    tok = build_tokenizer(load_config("glm-5.3-tiny"))
    compiler = GrammarCompiler(tok, args.vocab, [1])
    spec = make_spec("json_schema", SCHEMA)
    compiled = compiler.compile(spec)
    lines = [f"\n## bench_grammar_sampler: sampler time per step with a JSON-schema grammar ({args.device}, "
             f"vocab {args.vocab}, {platform.processor() or platform.machine()}, torch threads 1)\n",
             "| batch | sampler µs (no grammar) | sampler µs (grammar) | **extra µs per step** | extra µs per row |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for batch in (1, 64):
        r = run(batch, args.steps, args.vocab, args.device, compiler, compiled, spec)
        lines.append(f"| {batch} | {r['plain']:.0f} | {r['grammar']:.0f} | **{r['extra']:.0f}** | "
                     f"{r['extra'] / batch:.1f} |")
    text = "\n".join(lines)
    print(text)
    if args.append_results:
        path = Path(__file__).with_name("RESULTS.md")
        with path.open("a") as f:
            f.write(text + "\n")
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
