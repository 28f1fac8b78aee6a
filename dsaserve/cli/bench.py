"""`dsaserve bench`: serving benchmarks (measurement, never part of the request path).

    dsaserve bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --input-len 512 --output-len 128 \\
        --request-rate 8 --max-concurrency 32
    dsaserve bench serve --base-url URL --first-request --input-len 1024 --output-len 64
    dsaserve bench step [args of bench/bench_scheduler_step.py]

`bench serve` is an HTTP client in the manner of `vllm bench serve`: random prompts of fixed or random
length (`--random-range-ratio`, uniform in [L(1-r), L(1+r)] as vLLM), sent as token ids to
/v1/completions (exact input lengths) or as text to /v1/chat/completions, at a Poisson request rate
and/or a concurrency cap, all streamed. It reports TTFT, TPOT ((e2e - TTFT) / (output tokens - 1)), ITL
(gaps between streamed chunks) and end-to-end latency (mean and percentiles, ms), request and token
throughput. `--first-request` sends one request to a server that has served nothing of that shape,
then `--num-prompts` more of the same shape one at a time, and reports first against steady state
(the cold paths of note 000). Output tokens are the server's own `usage` counts.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dsaserve.common import envs

STEP_SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_scheduler_step.py"
# DSASERVE_BENCH_STEP_SCRIPT (common/envs.py): another script path (tests, out-of-tree checkouts)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="benchmarks: `bench serve` (HTTP client), `bench step` (scheduler)")
    sub = p.add_subparsers(dest="bench_command", metavar="BENCH")
    s = sub.add_parser("serve", help="benchmark a running OpenAI-compatible server",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="model name (default: the server's first model)")
    s.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--input-len", type=int, default=128, help="prompt tokens (completions: exact)")
    s.add_argument("--output-len", type=int, default=64, help="output tokens (EOS ignored)")
    s.add_argument("--random-range-ratio", type=float, default=0.0, help="0: fixed lengths; r: uniform ±r")
    s.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: at once)")
    s.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    s.add_argument("--first-request", action="store_true", help="first request vs later ones of the same shape")
    s.add_argument("--percentiles", default="50,90,99")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--api-key", default=None)
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
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


# ---- bench serve: one request -------------------------------------------------------------------
@dataclass
class Result:
    ok: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def _piece(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def send(client: Any, url: str, payload: dict[str, Any], headers: dict[str, str], prompt_len: int) -> Result:
    res = Result(prompt_len=prompt_len)
    t0 = time.perf_counter()
    last = t0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300].decode(errors='replace')}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    res.error = str(obj["error"].get("message"))[:300]
                    return res
                if obj.get("usage"):
                    res.output_tokens = obj["usage"]["completion_tokens"]
                if any(_piece(c) for c in obj.get("choices", [])):  # a chunk that carries generated text
                    now = time.perf_counter()
                    if res.ttft == 0.0:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
    except Exception as e:  # network errors count as failed requests, the run goes on
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = res.ttft > 0
    if not res.ok:
        res.error = "no output"
    return res


# ---- bench serve: workload ----------------------------------------------------------------------
_WORDS_TEXT = (
    "time person year way day thing man world life hand part child eye woman place work week case point "
    "number group problem fact model token cache page batch step layer expert router query"
)
WORDS = tuple(_WORDS_TEXT.split())


def _lengths(n: int, length: int, ratio: float, rng: random.Random) -> list[int]:
    lo, hi = max(1, int(length * (1 - ratio))), max(1, int(length * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def build_payloads(ns: argparse.Namespace, model: str, vocab: int, n: int, rng: random.Random
                   ) -> list[tuple[dict[str, Any], int]]:
    out = []
    for in_len, out_len in zip(_lengths(n, ns.input_len, ns.random_range_ratio, rng),
                               _lengths(n, ns.output_len, ns.random_range_ratio, rng), strict=True):
        common = {"model": model, "max_tokens": out_len, "stream": True, "ignore_eos": True, "temperature": 0.0,
                  "stream_options": {"include_usage": True}}
        if ns.endpoint == "completions":
            # ids from 7 on: past the special tokens of the built-in tokenizers; random, so no prefix is shared
            out.append(({**common, "prompt": [rng.randrange(7, vocab) for _ in range(in_len)]}, in_len))
        else:
            text = " ".join(rng.choice(WORDS) for _ in range(in_len))
            out.append(({**common, "messages": [{"role": "user", "content": text}]}, in_len))
    return out


async def run_load(ns: argparse.Namespace, url: str, headers: dict[str, str],
                   payloads: list[tuple[dict[str, Any], int]], rng: random.Random) -> tuple[list[Result], float]:
    import httpx

    sem = asyncio.Semaphore(ns.max_concurrency or len(payloads) or 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=ns.timeout, limits=limits) as client:
        async def limited(p: dict[str, Any], n: int) -> Result:
            async with sem:
                return await send(client, url, p, headers, n)

        tasks = []
        t0 = time.perf_counter()
        for p, n in payloads:
            tasks.append(asyncio.ensure_future(limited(p, n)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(ns.request_rate))  # Poisson arrivals, as vLLM
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


# ---- bench serve: report ------------------------------------------------------------------------
def _stats(values: list[float], pcts: list[float]) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"mean_ms": 0.0, **{f"p{p:g}_ms": 0.0 for p in pcts}}
    arr = np.asarray(values) * 1000.0
    return {"mean_ms": float(arr.mean()), **{f"p{p:g}_ms": float(np.percentile(arr, p)) for p in pcts}}


def summarize(results: list[Result], duration: float, pcts: list[float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tok = sum(r.output_tokens for r in ok)
    in_tok = sum(r.prompt_len for r in ok)
    return {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tok / duration if duration else 0.0,
        "total_token_throughput": (in_tok + out_tok) / duration if duration else 0.0,
        "ttft": _stats([r.ttft for r in ok], pcts),
        "tpot": _stats([t for r in ok if (t := r.tpot) is not None], pcts),
        "itl": _stats([x for r in ok for x in r.itl], pcts),
        "e2el": _stats([r.e2e for r in ok], pcts),
    }


def format_report(s: dict[str, Any], title: str) -> str:
    lines = [f"{'=' * 20} {title} {'=' * 20}"]
    for key in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput"):
        v = s[key]
        lines.append(f"{key:<32}{v:>14.2f}" if isinstance(v, float) else f"{key:<32}{v:>14}")
    for metric in ("ttft", "tpot", "itl", "e2el"):
        lines += [f"{'-' * 16} {metric.upper()} (ms) {'-' * 16}"]
        lines += [f"{k:<32}{v:>14.2f}" for k, v in s[metric].items()]
    lines += [f"error: {e}" for e in s["errors"]]
    return "\n".join(lines)


def _server_info(base: str, headers: dict[str, str]) -> tuple[str, int]:
    import httpx

    models = httpx.get(base + "/v1/models", headers=headers, timeout=30).raise_for_status().json()["data"]
    try:
        vocab = int(httpx.get(base + "/startup", headers=headers, timeout=30).json()["scheduler_info"]["vocab_size"])
    except (httpx.HTTPError, KeyError, TypeError, ValueError):
        vocab = 1000  # a server without the dsaserve manifest: stay inside any real vocabulary
    return models[0]["id"], vocab


def main_serve(ns: argparse.Namespace) -> int:
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(ns, name) <= 0:
            print(f"dsaserve bench serve: --{name.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    if not 0.0 <= ns.random_range_ratio < 1.0:
        print("dsaserve bench serve: --random-range-ratio must be in [0, 1)", file=sys.stderr)
        return 2
    base = ns.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    model, vocab = _server_info(base, headers)
    model = ns.model or model
    url = base + ("/v1/completions" if ns.endpoint == "completions" else "/v1/chat/completions")
    pcts = [float(p) for p in ns.percentiles.split(",")]
    rng = random.Random(ns.seed)
    if ns.first_request:
        report = first_request(ns, url, headers, model, vocab, rng, pcts)
    else:
        payloads = build_payloads(ns, model, vocab, ns.num_prompts, rng)
        results, duration = asyncio.run(run_load(ns, url, headers, payloads, rng))
        report = summarize(results, duration, pcts)
        print(format_report(report, "Serving Benchmark Result"))
    report["config"] = {k: v for k, v in vars(ns).items() if k not in ("func", "api_key")}
    if ns.json_out:
        Path(ns.json_out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if (report.get("failed", 0) == 0 and report.get("steady", {}).get("failed", 0) == 0) else 1


def first_request(ns: argparse.Namespace, url: str, headers: dict[str, str], model: str, vocab: int,
                  rng: random.Random, pcts: list[float]) -> dict[str, Any]:
    """One request, then num_prompts more of the same shape, one at a time: first vs steady state."""
    ns.random_range_ratio, ns.max_concurrency, ns.request_rate = 0.0, 1, float("inf")
    payloads = build_payloads(ns, model, vocab, ns.num_prompts + 1, rng)
    first, _ = asyncio.run(run_load(ns, url, headers, payloads[:1], rng))
    later, duration = asyncio.run(run_load(ns, url, headers, payloads[1:], rng))
    f, steady = first[0], summarize(later, duration, pcts)
    out = {"first": asdict(f) | {"tpot": f.tpot}, "steady": steady}
    if f.ok and steady["completed"]:
        out["ttft_first_over_steady_p50"] = f.ttft * 1000 / steady["ttft"]["p50_ms"]
        out["e2e_first_over_steady_p50"] = f.e2e * 1000 / steady["e2el"]["p50_ms"]
    print(f"{'=' * 20} First request vs steady state {'=' * 20}")
    print(f"first request   ok={f.ok} ttft={f.ttft * 1000:.2f} ms  e2e={f.e2e * 1000:.2f} ms  "
          f"tpot={(f.tpot or 0) * 1000:.2f} ms {f.error}")
    print(f"steady (p50)    ttft={steady['ttft']['p50_ms']:.2f} ms  e2e={steady['e2el']['p50_ms']:.2f} ms  "
          f"tpot={steady['tpot']['p50_ms']:.2f} ms over {steady['completed']} requests")
    if "ttft_first_over_steady_p50" in out:
        print(f"first / steady  ttft x{out['ttft_first_over_steady_p50']:.2f}  "
              f"e2e x{out['e2e_first_over_steady_p50']:.2f}")
    return out
