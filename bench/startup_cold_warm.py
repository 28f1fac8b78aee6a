"""Start-up, cold and warm (issue 16: "cold start (empty caches) to the first 200 of /health in <= 30 s for the
slice, and <= 5 s warm"): `dsaserve serve` started once per scenario, each timed by a stopwatch (Popen -> the
first 200 of /health) beside the manifest's `total_s` and phases (`GET /startup`), then one greedy completion with
its logprobs (every warm scenario must answer as the cold one did: `same_answer_as_cold`), then a short
mixed-length load whose `kernel_compiles_after_up` / `kernel_loads_after_up` must stay 0.

  cold_serial    empty caches, DSASERVE_PRECOMPILE=0: every Triton kernel compiles in the JIT, one at a time
                 (the start records its kernel specs: written to OUT/triton_specs.jsonl)
  cold_parallel  empty caches again, DSASERVE_KERNEL_SPECS=that list (as installed with the package): the
                 kernels compile on all cores while the engine imports and loads weights
  warm           cold_parallel's caches: its warm-start record too (engine/warm_start.py: the recorded kernels
                 preloaded, the memory profile reused, one attention-core shape per class instead of the row sweep),
                 and no precompile process (engine/compiled_specs.py: every listed
                 spec known compiled); the rank's CUDA context made while torch imports (engine/early_cuda.py)
  warm_again     the same once more (a warm start after a warm start: nothing left to record or replay)
  warm_noearly   the same caches, DSASERVE_EARLY_CUDA=0 (the A/B: the context made by torch's first allocation)
  warm_off       the same caches, DSASERVE_WARM_START=0 (the A/B: the full forward shape warmup, a fresh profile)
  warm_noprecompile  the same caches, DSASERVE_PRECOMPILE=0: what the precompile process (nothing left to compile
                 warm) costs the engine's imports and weight load it runs beside
  warm_cores     the same, DSASERVE_WARMUP_CORES_ONLY=1 (the shape warmup runs only the attention cores)

    PYTHONPATH=. python bench/startup_cold_warm.py --out $OUT --model glm-5.3-slice
    PYTHONPATH=. python bench/startup_cold_warm.py --out /tmp/s --model glm-5.3-tiny --device cpu  # CPU check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.serve_layouts import _metrics, _stop, _wait_healthy

# name -> (cache dir to use: "fresh" or an earlier scenario's, extra environment)
SCENARIOS = {
    "cold_serial": ("fresh", {"DSASERVE_PRECOMPILE": "0"}),
    "cold_parallel": ("fresh", {"DSASERVE_KERNEL_SPECS": "{specs}"}),
    "warm": ("cold_parallel", {}),
    "warm_again": ("cold_parallel", {}),
    "warm_noearly": ("cold_parallel", {"DSASERVE_EARLY_CUDA": "0"}),
    "warm_off": ("cold_parallel", {"DSASERVE_WARM_START": "0"}),
    "warm_noprecompile": ("cold_parallel", {"DSASERVE_PRECOMPILE": "0"}),
    "warm_cores": ("cold_parallel", {"DSASERVE_WARMUP_CORES_ONLY": "1"}),
    # the warm start under cProfile (common/startup_profile.py): which Python a warm start spends (slower itself)
    "warm_profiled": ("cold_parallel", {"DSASERVE_STARTUP_PROFILE": "{out}/profile"}),
}
AFTER_UP = ("kernel_compiles_after_up", "kernel_loads_after_up", "eager_fallback")


def scenario_env(name: str, caches: dict[str, Path], root: Path, specs: Path, out: Path) -> dict[str, str]:
    """The server's environment for one scenario: its cache root (a new one, or an earlier scenario's) and
    its switches; the caller's own TRITON_CACHE_DIR is dropped (the cache must be the scenario's)."""
    where, extra = SCENARIOS[name]
    caches[name] = caches.get(where) or root / name  # an earlier scenario's caches, when it ran
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_DIR", "DSASERVE_KERNEL_SPECS",
                                                            "DSASERVE_PRECOMPILE", "DSASERVE_WARMUP_CORES_ONLY",
                                                            "DSASERVE_WARM_START", "DSASERVE_EARLY_CUDA",
                                                            "DSASERVE_STARTUP_PROFILE")}
    env.update({k: v.format(specs=specs, out=out) for k, v in extra.items()}, DSASERVE_CACHE_DIR=str(caches[name]))
    return env


def _load(url: str, args: argparse.Namespace, out: Path) -> None:
    """Mixed lengths at some concurrency: prefill chunks, mixed steps and decode buckets after Up."""
    for conc, n in (tuple(int(x) for x in c.split("x")) for c in args.load.split(",")):
        cmd = [sys.executable, "-m", "dsaserve", "bench", "serve", "--base-url", url, "--input-len", str(n),
               "--output-len", str(args.output_len), "--num-prompts", str(2 * conc), "--max-concurrency",
               str(conc), "--disable-tqdm", "--json", str(out / f"load_c{conc}_in{n}.json")]
        subprocess.run(cmd, check=True, timeout=args.load_timeout, stdout=subprocess.DEVNULL)


PROBE_PROMPT = "def fibonacci(n):"  # the same greedy completion asked of every start (warm must answer as cold)


def _probe(url: str, model: str) -> dict:
    """One greedy completion with its token logprobs: a warm start reuses kernels, a memory profile and graphs
    captured without their own eager runs, so it must give what the cold start gave."""
    body = json.dumps({"model": model, "prompt": PROBE_PROMPT, "max_tokens": 8, "temperature": 0,
                       "logprobs": 1}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        choice = json.loads(r.read())["choices"][0]
    return {"text": choice["text"], "token_logprobs": choice["logprobs"]["token_logprobs"]}


def same_answer(a: dict | None, b: dict | None, tol: float = 1e-3) -> bool | None:
    """Whether two starts' probes agree: the same text, each token's logprob within tol (None: one is missing)."""
    if not a or not b:
        return None
    la, lb = a["token_logprobs"], b["token_logprobs"]
    return a["text"] == b["text"] and len(la) == len(lb) and all(
        x is not None and y is not None and abs(x - y) <= tol for x, y in zip(la, lb, strict=True))


def run_one(name: str, env: dict[str, str], args: argparse.Namespace, out: Path) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    cmd = [sys.executable, "-m", "dsaserve", "serve", "--model", args.model, "--load-format", "dummy",
           "--device", args.device, "--port", str(args.port), *args.serve_args.split()]
    res: dict = {"scenario": name, "env": {k: env[k] for k in env if k.startswith("DSASERVE_")}}
    with open(out / f"{name}.log", "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_healthy(url, proc, args.start_timeout)
        res["healthy_after_s"] = round(time.perf_counter() - t0, 2)  # from Popen: the stopwatch
        with urllib.request.urlopen(f"{url}/startup", timeout=10) as r:
            manifest = json.loads(r.read())
        res["manifest_total_s"] = manifest["startup"]["total_s"]
        res["phases"] = manifest["startup_time"]
        res["caches"] = manifest["startup"]["caches"]
        res["precompile"] = (manifest.get("engine") or {}).get("kernel_precompile")
        res["warmed_shapes"] = (manifest.get("engine") or {}).get("warmed_shapes")
        res["warmed_prefill_chunks"] = (manifest.get("engine") or {}).get("warmed_prefill_chunks")
        res["warm_start"] = (manifest.get("engine") or {}).get("warm_start")
        res["early_cuda"] = (manifest.get("engine") or {}).get("early_cuda_context")
        res["load_weights_parts"] = (manifest.get("weights") or {}).get("phases")
        res["probe"] = _probe(url, args.model)
        if not args.no_load:
            _load(url, args, out)
        res["after_up"] = {k: v for k, v in _metrics(url).items() if any(m in k for m in AFTER_UP)}
    except Exception as e:  # one scenario failing must not lose the others
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        _stop(proc)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="glm-5.3-slice")
    p.add_argument("--device", default="cuda")
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--serve-args", default="")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--load", default="1x64,8x700,16x2000", help="concurrency x input tokens after Up")
    p.add_argument("--no-load", action="store_true", help="skip the load after Up")
    p.add_argument("--start-timeout", type=float, default=150)
    p.add_argument("--load-timeout", type=float, default=60)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dsaserve-startup-"))
    specs, caches, rows = out / "triton_specs.jsonl", {}, []
    try:
        for name in args.scenarios.split(","):
            env = scenario_env(name, caches, root, specs, out)
            res = run_one(name, env, args, out)
            recorded = caches[name] / "triton_specs.jsonl"
            if recorded.is_file():  # each start's list (a new kernel's specs, to ship in engine/kernel_specs)
                shutil.copy(recorded, out / f"triton_specs_{name}.jsonl")
                if name == "cold_serial":
                    shutil.copy(recorded, specs)
            cold = next((r.get("probe") for r in rows if r["scenario"].startswith("cold")), None)
            if not name.startswith("cold"):
                res["same_answer_as_cold"] = same_answer(res.get("probe"), cold)
            rows.append(res)
            (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
            print(f"{name}: healthy {res.get('healthy_after_s')} s, manifest {res.get('manifest_total_s')} s"
                  + (f", answer as cold: {res['same_answer_as_cold']}" if "same_answer_as_cold" in res else "")
                  + (f", error {res['error']}" if "error" in res else ""), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print_table(rows)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))


def _warm(r: dict) -> str:
    """The warm-start record's use: preload status (specs, seconds), memory profile, core warmup."""
    w = r.get("warm_start") or {}
    pre = w.get("preload") or {}
    core = "sweep" if (r.get("warmed_shapes") or {}).get("core_warmup", "row sweep") == "row sweep" else "class"
    if not w:
        return "-"
    return f"{pre.get('status')} {pre.get('specs', 0)}/{pre.get('seconds', 0)}s prof {w.get('memory_profile')} {core}"


ANSWER = {True: "as cold", False: "DIFFERS", None: "-"}  # a warm start's probe against the cold start's


def print_table(rows: list[dict]) -> None:
    print(f"\n{'scenario':>14} {'healthy s':>9} {'manifest s':>10} {'precompile':>28} {'warm start':>26} "
          f"{'answer':>7}  after Up")
    for r in rows:
        pc = r.get("precompile") or {}
        pre = (f"{pc.get('compiled', '-')}/{pc.get('specs', '-')} in {pc.get('wall_s', '-')}s w{pc.get('waited_s')}"
               if pc.get("status") == "ran" else str(pc.get("status", "-")))
        if str(pc.get("status", "")).startswith("skipped"):
            pre = f"skipped ({pc.get('specs')} known)"
        print(f"{r['scenario']:>14} {r.get('healthy_after_s', float('nan')):>9} "
              f"{r.get('manifest_total_s') or float('nan'):>10} {pre:>28} {_warm(r):>26} "
              f"{ANSWER[r.get('same_answer_as_cold')]:>7}  {r.get('after_up', r.get('error'))}")
    for r in rows:
        top = sorted(((v, k) for k, v in (r.get("phases") or {}).items() if isinstance(v, (int, float))
                      and k not in ("total_s", "up", "scheduler_ready", "detokenizer_ready")), reverse=True)[:12]
        print(f"{r['scenario']:>14} phases: " + ", ".join(f"{k} {v:.2f}" for v, k in top))
        parts, early = r.get("load_weights_parts") or {}, r.get("early_cuda") or {}
        print(f"{'':>14} load_weights: " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
              + f"; early CUDA context: {early.get('status')}" + (f" {early['seconds']}s" if 'seconds' in early else '')
              + f"; prefill warmup: {r.get('warmed_prefill_chunks')}")


if __name__ == "__main__":
    main()
