"""`dsaserve bench serve`: arguments, the load run with a progress bar, the first-request mode.

Owns: the command's options and its flow: ask the server its model and vocabulary, make the dataset, send
it (Poisson arrivals at --request-rate, at most --max-concurrency in flight) under a tqdm bar, print the
summary table, write --json. `--first-request` reads the server's request counter first and warns when the
server has already served requests (then the first request is not a cold one), streams the first request
under a token bar, then sends --num-prompts more of the same shape one at a time: first against steady.
The key is --api-key, else DSASERVE_API_KEY (as `dsaserve serve` reads it). A server that cannot be asked its
model (none at --base-url, a URL without http://, a key wanted or refused) ends the run in one line: exit 2
for a flag to fix, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any
from urllib.parse import urlsplit

from dsaserve.bench import report
from dsaserve.bench.client import TOKEN_COUNTS, payload, requests_served, run_load, server_info
from dsaserve.bench.datasets import DATASETS, BenchRequest, make_requests
from dsaserve.bench.metrics import summarize
from dsaserve.common import envs
from dsaserve.server.server_args import API_KEY_ENV


def add_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="model name (default: the server's first model)")
    s.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="completions: prompts as token ids (exact lengths); chat: prompts as words")
    s.add_argument("--dataset", choices=DATASETS, default="random", help="see dsaserve/bench/datasets.py")
    s.add_argument("--num-prompts", type=int, default=64, help="requests to send")
    s.add_argument("--input-len", type=int, default=128, help="random: prompt tokens")
    s.add_argument("--output-len", type=int, default=64, help="random: output tokens (max_tokens)")
    s.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="random: 0 fixed lengths; r: uniform in [L(1-r), L(1+r)]")
    s.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="sharegpt-like: fixed output length (default: the dataset's)")
    s.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: at once)")
    s.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: no limit)")
    s.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate max_tokens whatever the model samples")
    s.add_argument("--token-counts", choices=TOKEN_COUNTS, default=TOKEN_COUNTS[0],
                   help="how each chunk's tokens are counted (see dsaserve/bench/client.py)")
    s.add_argument("--first-request", action="store_true",
                   help="first request vs later ones of the same shape (random ids, --input-len / --output-len)")
    s.add_argument("--percentiles", default="99", help="percentiles in the table (and the JSON)")
    s.add_argument("--seed", type=int, default=0, help="seed of the dataset and the arrival times")
    s.add_argument("--api-key", default=None,
                   help=f"sent as `Authorization: Bearer KEY` (default: the {API_KEY_ENV} environment variable, "
                        "as `dsaserve serve` reads it; unset: no key)")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    s.add_argument("--disable-tqdm", action="store_true")
    s.add_argument("--json", dest="json_out", default=None, help="also write every number to this file")


def _check(ns: argparse.Namespace) -> str | None:
    url = urlsplit(ns.base_url)
    if url.scheme not in ("http", "https") or not url.netloc:
        return f"--base-url {ns.base_url!r}: needs http:// or https:// and a host, e.g. http://127.0.0.1:8000"
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(ns, name) <= 0:
            return f"--{name.replace('_', '-')} must be positive"
    if not 0.0 <= ns.range_ratio < 1.0:
        return "--range-ratio must be in [0, 1)"
    if ns.max_concurrency is not None and ns.max_concurrency <= 0:
        return "--max-concurrency must be positive"
    if not ns.request_rate > 0:
        return "--request-rate must be positive"
    return None


class Run:
    """One invocation: the server's identity and what every request shares."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.base = ns.base_url.rstrip("/")
        key = ns.api_key or envs.DSASERVE_API_KEY
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        model, self.vocab = _ask_server(self.base, self.headers)
        self.model = ns.model or model
        self.url = self.base + ("/v1/completions" if ns.endpoint == "completions" else "/v1/chat/completions")
        self.pcts = [float(p) for p in ns.percentiles.split(",")]

    def requests(self, dataset: str, n: int, range_ratio: float, seed: int) -> list[tuple[BenchRequest, dict]]:
        ns = self.ns
        reqs = make_requests(dataset, n, input_len=ns.input_len, output_len=ns.output_len, range_ratio=range_ratio,
                             vocab=self.vocab, as_text=ns.endpoint == "chat", seed=seed,
                             fixed_output_len=ns.sharegpt_output_len if dataset == "sharegpt-like" else None)
        return [(r, payload(r, self.model, ns.endpoint, ns.token_counts, ns.ignore_eos)) for r in reqs]

    def load(self, work: list[tuple[BenchRequest, dict]], rate: float, concurrency: int | None,
             desc: str, unit: str = "req") -> tuple[list, float]:
        from tqdm import tqdm

        total = len(work) if unit == "req" else sum(r.output_len for r, _ in work)
        with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=self.ns.disable_tqdm) as bar:
            per_token = (lambda k: bar.update(k)) if unit == "tok" else None
            per_req = (lambda rec: bar.update(1)) if unit == "req" else None
            return asyncio.run(run_load(self.url, self.headers, work, request_rate=rate, max_concurrency=concurrency,
                                        seed=self.ns.seed, timeout=self.ns.timeout, on_done=per_req,
                                        on_tokens=per_token, on_tick=bar.refresh))


class Unusable(Exception):
    """The server could not be asked its model: a one-line reason, and the exit status (2: a flag to fix)."""

    def __init__(self, reason: str, status: int) -> None:
        super().__init__(reason)
        self.status = status


def _ask_server(base: str, headers: dict[str, str]) -> tuple[str, int]:
    """server_info, its httpx errors made one line that names --base-url or the key."""
    import httpx

    try:
        return server_info(base, headers)
    except httpx.HTTPStatusError as e:
        raise _status_error(base, e.response.status_code, bool(headers)) from None
    except httpx.ConnectError as e:
        raise Unusable(f"no server at --base-url {base} ({e}); is `dsaserve serve` running there?", 1) from None
    except httpx.HTTPError as e:
        raise Unusable(f"--base-url {base}: GET /v1/models failed: {type(e).__name__}: {e}", 1) from None
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise Unusable(f"--base-url {base}: /v1/models is not an OpenAI model list ({type(e).__name__}: {e})",
                       1) from None


def _status_error(base: str, status: int, keyed: bool) -> Unusable:
    asked = f"{base} answered HTTP {status} to GET /v1/models"
    if status in (401, 403) and keyed:
        return Unusable(f"{asked}: it refused the key given (--api-key, else {API_KEY_ENV})", 2)
    if status in (401, 403):
        return Unusable(f"{asked}: it wants an API key: pass --api-key KEY or set {API_KEY_ENV}", 2)
    if status == 404:
        return Unusable(f"{asked}: is --base-url the server's root (no /v1)?", 2)
    return Unusable(asked, 1)


def main_serve(ns: argparse.Namespace) -> int:
    problem = _check(ns)
    if problem:
        print(f"dsaserve bench serve: {problem}", file=sys.stderr)
        return 2
    try:
        run = Run(ns)
    except Unusable as e:
        print(f"dsaserve bench serve: {e}", file=sys.stderr)
        return e.status
    out = first_request(run) if ns.first_request else benchmark(run)
    out["config"] = {k: v for k, v in vars(ns).items() if k not in ("func", "api_key")}
    if ns.json_out:
        report.write_json(ns.json_out, out)
    failed = out["failed"] if "failed" in out else out["first"]["failed"] + out["steady"]["failed"]
    return 0 if failed == 0 else 1


def benchmark(run: Run) -> dict[str, Any]:
    ns = run.ns
    work = run.requests(ns.dataset, ns.num_prompts, ns.range_ratio, ns.seed)
    records, duration = run.load(work, ns.request_rate, ns.max_concurrency, "bench serve")
    s = summarize(records, duration, run.pcts)
    s |= {"max_concurrency": ns.max_concurrency, "request_rate": ns.request_rate}
    _print(report.format_table(s, run.pcts), report.warnings(s))
    return s


def first_request(run: Run) -> dict[str, Any]:
    """One request, then num_prompts more of the same shape one at a time: first vs steady state."""
    ns = run.ns
    served = requests_served(run.base, run.headers)
    if served:
        print(f"WARNING: the server has already served {served:g} requests (/metrics); the first request "
              "below may take no cold path. Restart the server for a true first request.", file=sys.stderr)
    work = run.requests("random", ns.num_prompts + 1, 0.0, ns.seed)
    print(f"first request: {ns.input_len} tokens in, {ns.output_len} out ...", file=sys.stderr, flush=True)
    first_recs, first_s = run.load(work[:1], float("inf"), 1, "first request", unit="tok")
    first = summarize(first_recs, first_s, run.pcts)
    _print(report.format_table(first, run.pcts, "First Request"), report.warnings(first))
    recs, duration = run.load(work[1:], float("inf"), 1, "steady requests")
    steady = summarize(recs, duration, run.pcts)
    _print(report.format_table(steady, run.pcts, "Steady State (one at a time)"), report.warnings(steady))
    out: dict[str, Any] = {"server_requests_before": served, "first": first, "steady": steady}
    if first["completed"] and steady["median_ttft_ms"] > 0 and steady["median_e2el_ms"] > 0:
        for key in ("ttft", "e2el"):
            out[f"{key}_first_over_steady_median"] = first[f"mean_{key}_ms"] / steady[f"median_{key}_ms"]
        print(f"first / steady median: TTFT x{out['ttft_first_over_steady_median']:.2f}  "
              f"E2EL x{out['e2el_first_over_steady_median']:.2f}")
    return out


def _print(table: str, notes: list[str]) -> None:
    print(table, flush=True)
    for note in notes:
        print(f"WARNING: {note}", file=sys.stderr)
