"""The server under load, one layout after another (issue "Several GPUs measured": `dsaserve bench serve` output
tokens/s at concurrency 1/32/128 per layout): start `dsaserve serve` with the layout's flags, wait for the
first 200 of /health, run `dsaserve bench serve` at each concurrency, scrape /metrics (graph replays, eager
fallbacks, compiles after Up), stop the server, next layout. One JSON per layout and a table at the end.

    PYTHONPATH=. python bench/serve_layouts.py --out DIR --model glm-5.3-slice --layouts tp1,tp2,dp2ep2
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LAYOUTS = {"tp1": [], "tp2": ["--tp", "2"], "ep2": ["--ep", "2"], "tp2ep2": ["--tp", "2", "--ep", "2"],
           "dp2ep2": ["--tp", "2", "--ep", "2", "--enable-dp-attention"]}
METRICS = ("dsaserve_graph_replays", "dsaserve_eager_fallback", "kernel_compiles_after_up")


def _wait_healthy(url: str, proc: subprocess.Popen, limit_s: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"no 200 from {url}/health in {limit_s:.0f} s")


def _metrics(url: str) -> dict[str, str]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {ln.split(" ")[0]: ln.split(" ")[-1] for ln in lines if any(m in ln for m in METRICS)
            and not ln.startswith("#")}


def _bench(url: str, conc: int, args: argparse.Namespace, out: Path) -> dict:
    path = out / f"conc{conc}.json"
    cmd = [sys.executable, "-m", "dsaserve", "bench", "serve", "--base-url", url, "--input-len",
           str(args.input_len), "--output-len", str(args.output_len), "--num-prompts", str(max(8, 2 * conc)),
           "--max-concurrency", str(conc), "--disable-tqdm", "--json", str(path)]
    subprocess.run(cmd, check=True, timeout=args.bench_timeout)
    return json.loads(path.read_text())


def run_layout(name: str, args: argparse.Namespace) -> dict:
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "dsaserve", "serve", "--model", args.model, "--load-format", "dummy",
           "--device", args.device, "--port", str(args.port), *LAYOUTS[name], *args.serve_args.split()]
    with open(out / "server.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    res: dict = {"layout": name, "cmd": " ".join(cmd)}
    try:
        res["healthy_after_s"] = round(_wait_healthy(url, proc, args.start_timeout), 2)
        res["runs"] = {c: _bench(url, c, args, out) for c in args.concurrency}
        res["metrics"] = _metrics(url)
    except Exception as e:  # one layout failing must not lose the others
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    (out / "result.json").write_text(json.dumps(res, indent=1))
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="glm-5.3-slice")
    p.add_argument("--layouts", default="tp1,tp2")
    p.add_argument("--concurrency", default="1,32,128")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--device", default="cuda")
    p.add_argument("--serve-args", default="", help="more flags for every server")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--bench-timeout", type=float, default=300)
    args = p.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    rows = [run_layout(name, args) for name in args.layouts.split(",")]
    print(f"{'layout':>8} {'healthy s':>9} " + " ".join(f"{'c=' + str(c) + ' tok/s':>12}" for c in args.concurrency))
    for r in rows:
        tps = [r.get("runs", {}).get(c, {}).get("output_throughput", float("nan")) for c in args.concurrency]
        print(f"{r['layout']:>8} {r.get('healthy_after_s', float('nan')):>9} "
              + " ".join(f"{t:>12.1f}" for t in tps) + (f"  {r['error']}" if "error" in r else ""))


if __name__ == "__main__":
    main()
