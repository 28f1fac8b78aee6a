"""`dsaserve eval`: held-out perplexity and greedy agreement between numerics settings.

    dsaserve eval                                      # the built-in glm-5.3-mini, every comparison that applies
    dsaserve eval --model DIR --groups kv,sparse --json out.json --windows 8 --prompts 10

Comparisons (each setting's perplexity on the checkpoint's held-out split, and how many greedy
continuations of held-out prompts are identical to its reference's, and for each that parts, the step and
both runs' top-1 margins there: a parting at a near-tie is rounding, one at a wide margin an error):
  kv       KV layouts bf16 / fp8_ds_mla / fp8_e4m3 against fp32
  sparse   dense attention (index_topk >= context) against the sparse base
  indexer  every layer running its own indexer against GLM's shared layers
  fp8_act  (GPU) FP8 activations off against on (DSASERVE_FP8_ACTIVATIONS)
  cpu_ref  the CPU path computing in bfloat16 against the float32 CPU reference (how far bf16 rounding alone
           moves greedy); on a GPU also the GPU path against both, same KV layout
  fp32_head (GPU) the GPU path with a float32 lm_head output (DSASERVE_FP32_LM_HEAD) against the CPU
           reference and against the bf16 lm_head: bf16 logits make close tokens tie exactly
  gpu_fp32 (GPU) the GPU path in float32 without FP8 activations against the CPU reference (kernel order alone)
  graphs   (GPU) greedy through the CUDA graphs serving replays, --batch prompts a step, against the eager base;
           with the cuBLASLt choices on (DSASERVE_GEMM_TUNING), also against the same graphs on torch's choices
  hf       each KV layout run against HF transformers (float32, CPU; checkpoints up to 4 GiB) whose cached
           latent and indexer keys go through that layout's codec: the fair oracle of a quantised layout
Needs a checkpoint with its tokenizer; the held-out split is rebuilt from corpus_recipe.json when present, out of
the running Python's standard library: under another Python than the model was trained on it is other text, with
another perplexity, and a WARNING says so (both Pythons, held-out files and tokens).
Exit status: 1 when a setting FAILED (the others still run and are reported), 2 for a bad flag or too little
held-out text.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(subparsers: Any) -> None:
    from dsaserve.common.kv_layout import ENGINE_KV_LAYOUTS
    from dsaserve.quality.report import ALL_GROUPS, EvalArgs

    d = EvalArgs(model="")
    p = subparsers.add_parser("eval", help="held-out perplexity and greedy agreement between settings",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="glm-5.3-mini",
                   help="checkpoint directory (with tokenizer.json) or built-in name (default: glm-5.3-mini)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--kv-layout", default=d.kv_layout, choices=ENGINE_KV_LAYOUTS,
                   help="KV layout of the base setting")
    p.add_argument("--groups", default=",".join(ALL_GROUPS), help=f"comma-separated subset of {','.join(ALL_GROUPS)}")
    p.add_argument("--windows", type=positive_int, default=d.windows, help="held-out windows for perplexity")
    p.add_argument("--window-len", type=positive_int, default=d.window_len, help="tokens per window")
    p.add_argument("--batch", type=positive_int, default=d.batch, help="windows per prefill")
    p.add_argument("--prompts", type=positive_int, default=d.prompts, help="held-out prompts for greedy agreement")
    p.add_argument("--prompt-len", type=positive_int, default=d.prompt_len)
    p.add_argument("--max-tokens", type=positive_int, default=d.max_tokens, help="greedy tokens per prompt")
    p.add_argument("--max-files", type=positive_int, default=None, help="read only the first N stdlib files (tests)")
    p.add_argument("--json", default=None, help="also write the full result here")
    p.set_defaults(func=run)


def positive_int(text: str) -> int:
    """argparse type of the count flags: a count below 1 would divide by zero or run nothing."""
    try:
        value: int | None = int(text)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    import torch

    from dsaserve.quality.report import ALL_GROUPS, EvalArgs, run_eval

    groups = tuple(g.strip() for g in args.groups.split(",") if g.strip())
    bad = [g for g in groups if g not in ALL_GROUPS]
    if bad:
        print(f"dsaserve eval: error: --groups: unknown {bad[0]!r} (one of {', '.join(ALL_GROUPS)})", file=sys.stderr)
        return 2
    if args.prompt_len > args.window_len:  # prompts are cut from the held-out windows: it would be cut to them
        print(f"dsaserve eval: error: --prompt-len: {args.prompt_len} is longer than --window-len {args.window_len}, "
              "the held-out windows prompts are cut from", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a = EvalArgs(model=args.model, device=device, kv_layout=args.kv_layout, groups=groups, windows=args.windows,
                 window_len=args.window_len, batch=args.batch, prompts=args.prompts, prompt_len=args.prompt_len,
                 max_tokens=args.max_tokens, json_path=args.json, max_files=args.max_files)
    try:
        out = run_eval(a, log=lambda s: print(s, flush=True), warn=lambda s: print(s, file=sys.stderr, flush=True))
    except ValueError as e:
        print(f"dsaserve eval: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(f"wrote {args.json} ({len(json.dumps(out))} bytes)", file=sys.stderr)
    return _failed(out)


def _failed(out: dict) -> int:
    """1 when a setting FAILED (its comparisons are missing from the table), else 0."""
    failed = list(out["errors"])
    if not failed:
        return 0
    total = len(failed) + len(out["results"])
    print(f"dsaserve eval: {len(failed)} of {total} settings FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1
