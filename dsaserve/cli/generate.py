"""`dsaserve generate`: one prompt through the offline Engine (the whole request path in one process).

    dsaserve generate --prompt "Hello" --max-tokens 16                 # built-in glm-5.3-mini (trained), greedy
    dsaserve generate --model DIR --prompt-ids 1,2,3 --max-tokens 8 --temperature 0.8 --seed 1 --json

Every engine argument (`--dtype`, `--kv-layout`, `--num-pages`, `--max-num-batched-tokens`, ...) is
accepted with the same meaning as in `dsaserve serve`. `--temperature` defaults to 0 (greedy) here,
so the command is reproducible; `--seed` seeds sampling when it is not greedy. `--json` prints one JSON
object: prompt_token_ids, token_ids, text, finish_reason, num_cached_tokens, logprobs, prompt_logprobs,
seconds, startup_time. `--prompt-logprobs N` scores the prompt itself (each token's logprob given the ones before
it, its rank and the top-N; the text output adds the prompt's perplexity).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any


def register(subparsers: Any) -> None:
    from dsaserve.engine.engine_args import EngineArgs

    p = subparsers.add_parser("generate", help="generate from one prompt (offline engine)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--logprobs", type=int, default=None, help="return the top-N logprobs of every token")
    p.add_argument("--prompt-logprobs", type=int, default=None,
                   help="score the prompt: each token's logprob and rank, with the top-N alternatives")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise ValueError(f"--prompt-ids: expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids: no token ids given")
    return ids


def run(args: argparse.Namespace) -> int:
    from dsaserve.common.sampling_params import SamplingParams
    from dsaserve.engine.engine import Engine
    from dsaserve.engine.engine_args import EngineArgs

    try:
        prompt: str | list[int] = args.prompt if args.prompt is not None else parse_ids(args.prompt_ids)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, min_p=args.min_p, stop=args.stop, ignore_eos=args.ignore_eos,
                                logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)
        engine_args = EngineArgs.from_cli_args(args)
    except ValueError as e:
        print(f"dsaserve generate: error: {e}", file=sys.stderr)
        return 2
    kw = {k: v for k, v in engine_args.__dict__.items() if k != "model"}
    try:
        engine = Engine(engine_args.model, **kw)  # a broken checkpoint: a one-line CheckpointError (a ValueError)
        t0 = time.perf_counter()
        out = engine.generate(prompt, params)[0]
        seconds = time.perf_counter() - t0
    except ValueError as e:
        print(f"dsaserve generate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "prompt_token_ids": out.prompt_token_ids, "token_ids": out.token_ids, "text": out.text,
            "finish_reason": out.finish_reason, "num_cached_tokens": out.num_cached_tokens,
            "logprobs": out.logprobs, "prompt_logprobs": out.prompt_logprobs, "seconds": round(seconds, 4),
            "startup_time": engine.core.scheduler_info["startup_time"],
        }))
    else:
        print(out.text)
        print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}, {seconds:.2f}s]", file=sys.stderr)
        scored = [e["logprob"] for e in out.prompt_logprobs or [] if e is not None]
        if scored:
            print(f"[prompt: {len(scored)} tokens scored, logprob {sum(scored):.3f}, perplexity "
                  f"{math.exp(-sum(scored) / len(scored)):.3f}]", file=sys.stderr)
    return 0
