"""`dsaserve ledger`: the notes' arithmetic as a tool — predict, plot, reconcile (planning; no request-path
stage).

Owns: the command-line flags (model, deployment, hardware overrides, workload, assumptions, output
format) and their mapping onto dsaserve.ledger. Imports no torch unless `--reconcile` runs the engine.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from dsaserve.common.kv_layout import DEFAULT_KV_LAYOUT, ENGINE_KV_LAYOUTS, KV_LAYOUTS
from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.units import US, parse_tokens

ENGINE_RUN = {"reconcile_model": "glm-5.3-tiny", "reconcile_prompts": "5,17,70", "reconcile_max_tokens": 6,
              "reconcile_device": "cpu"}  # `--reconcile` with no RUN.json runs the engine so


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("ledger", help="predict every byte, FLOP and collective of a step; --reconcile",
                              description="The cost ledger of docs/LEDGER.md: every table of the design notes "
                                          "for any config.json and deployment.")
    g = p.add_argument_group("model and deployment")
    g.add_argument("--model", default="glm-5.3", help="built-in name or config.json / checkpoint dir (glm-5.3)")
    g.add_argument("--tp", type=int, default=8, help="tensor-parallel size (8)")
    g.add_argument("--ep", type=int, default=1, help="expert-parallel size (1 = experts TP-split)")
    g.add_argument("--dp-attention", action="store_true", help="attention data-parallel over the TP ranks")
    g.add_argument("--pd", action="store_true", help="prefill/decode disaggregated (PD handoff per request)")
    g.add_argument("--gpus", type=int, default=0, help="GPUs in the deployment (0 = max(tp, ep))")
    h = p.add_argument_group("hardware (preset, then overrides)")
    h.add_argument("--hardware", default="h200", choices=sorted(PRESETS), help="preset (h200)")
    h.add_argument("--hbm-gb", type=float, help="device memory, GB")
    h.add_argument("--hbm-tbs", type=float, help="HBM bandwidth, TB/s")
    h.add_argument("--bf16-tflops", type=float, help="dense BF16 TFLOP/s")
    h.add_argument("--fp8-tflops", type=float, help="dense FP8 TFLOP/s")
    h.add_argument("--nvlink-gbs", type=float, help="NVLink GB/s per GPU per direction")
    h.add_argument("--ib-gbs", type=float, help="IB GB/s per GPU per direction")
    h.add_argument("--nvlink-overhead-us", type=float, help="fixed cost of one collective on NVLink, us")
    h.add_argument("--ib-overhead-us", type=float, help="fixed cost of one collective over IB, us")
    w = p.add_argument_group("workload")
    w.add_argument("--kv-layout", default=DEFAULT_KV_LAYOUT, choices=tuple(KV_LAYOUTS))
    w.add_argument("--context", default="1M", help="long-request context: capacity, PD, prefill (1M = 2^20)")
    w.add_argument("--batch", type=int, default=32, help="decode requests per step, whole deployment (32)")
    w.add_argument("--decode-context", default="128K", help="context of each request in the decode step (128K)")
    w.add_argument("--chunk", default="32768", help="chunked_prefill_size (32768)")
    w.add_argument("--prompt", default="20000", help="first-request prompt tokens (20000)")
    w.add_argument("--prefix-hit", default="19000", help="of which already cached (19000)")
    a = p.add_argument_group("assumptions (docs/LEDGER.md lists all)")
    a.add_argument("--mem-fraction-static", type=float, help="share of HBM for weights + KV pool (0.85)")
    a.add_argument("--indexer-q-tile", type=int, help="queries sharing one read of an indexer key (32)")
    a.add_argument("--mla-kv", choices=("replicated", "split"), help="pure-TP MLA KV per rank (replicated)")
    a.add_argument("--speculative-num-steps", type=int, metavar="K",
                   help="speculative decoding with the MTP layer on, K drafts a request a step (1-8; off)")
    a.add_argument("--draft-acceptance", metavar="A[,A2,...]",
                   help="chance a draft is kept when the ones before it were (0.8); several: positions 1, 2, ...")
    a.add_argument("--assume", action="append", default=[], metavar="KEY=VALUE", help="set any assumption")
    o = p.add_argument_group("output")
    fmt = o.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="JSON (stable keys, docs/LEDGER.md)")
    fmt.add_argument("--markdown", action="store_true", help="markdown tables")
    o.add_argument("--sections", help="comma-separated section keys (default: all)")
    o.add_argument("--notes-check", dest="notes", action="store_true", default=None,
                   help="add the notes' figures check (default for glm-5.3)")
    o.add_argument("--no-notes-check", dest="notes", action="store_false")
    o.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    o.add_argument("--out", metavar="FILE", help="write the report to FILE instead of stdout")
    r = p.add_argument_group("reconcile")
    r.add_argument("--reconcile", nargs="?", const="", metavar="RUN.json",
                   help="predicted vs measured: read a saved run, or (no file) run the engine on --reconcile-model")
    # defaults None, filled in by `engine_run_settings`: a flag set without an engine run is an error, not ignored
    r.add_argument("--reconcile-model", help=f"model the engine runs ({ENGINE_RUN['reconcile_model']})")
    r.add_argument("--reconcile-prompts", help=f"prompt lengths, comma-separated ({ENGINE_RUN['reconcile_prompts']})")
    r.add_argument("--reconcile-max-tokens", type=int,
                   help=f"tokens generated per prompt ({ENGINE_RUN['reconcile_max_tokens']})")
    r.add_argument("--reconcile-device", choices=("cpu", "cuda"),
                   help=f"where the engine runs ({ENGINE_RUN['reconcile_device']})")
    r.add_argument("--measured", metavar="RUN.json",
                   help="a GPU run's decode steps (bench/bench_gpu.py's JSON) against the ledger, and a time model "
                        "fitted to them")
    r.add_argument("--save-run", metavar="FILE",
                   help="save the engine run's counters as a run file (with --reconcile and no RUN.json)")
    p.set_defaults(func=main)


# flag dest -> (Hardware field, what one unit of the flag is in SI)
HARDWARE_FLAGS = {"hbm_gb": ("hbm_bytes", 1e9), "hbm_tbs": ("hbm_bw", 1e12), "bf16_tflops": ("bf16_flops", 1e12),
                  "fp8_tflops": ("fp8_flops", 1e12), "nvlink_gbs": ("nvlink_bw", 1e9), "ib_gbs": ("ib_bw", 1e9),
                  "nvlink_overhead_us": ("nvlink_overhead_s", US), "ib_overhead_us": ("ib_overhead_s", US)}


def _hardware(args: argparse.Namespace):
    """The preset with the overrides; a bad value is named by its flag and as typed (Hardware sees SI units)."""
    from dsaserve.ledger.hardware import checked_value, get_hardware

    over = {}
    for dest, (name, unit) in HARDWARE_FLAGS.items():
        v = getattr(args, dest)
        if v is not None:  # checked as typed: the flag and its value in the message, not SI units
            over[name] = checked_value(name, v, f"--{dest.replace('_', '-')}") * unit
    return get_hardware(args.hardware).with_overrides(**over)


def _assumptions(args: argparse.Namespace):
    """--assume KEY=VALUE, then the assumptions' own flags over them (errors name whichever set the value)."""
    from dsaserve.ledger.deployment import ASSUMPTION_FLAGS, Assumptions

    updates: dict[str, object] = {}
    for item in args.assume:
        if "=" not in item:
            raise ValueError(f"--assume: {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        updates[k.strip()] = v.strip()
    flagged = {k: getattr(args, k) for k in ASSUMPTION_FLAGS if getattr(args, k, None) is not None}
    if args.draft_acceptance is not None and "," in args.draft_acceptance:  # rates by position
        flagged["draft_acceptance_by_position"] = flagged.pop("draft_acceptance")
    if args.speculative_num_steps is not None:  # the flag is the engine's: drafting at all is what it asks
        if str(updates.get("speculative", "true")).lower() in ("0", "false", "no", "off"):
            raise ValueError("--speculative-num-steps: speculation is turned off by --assume speculative="
                             f"{updates['speculative']}")
        updates["speculative"] = "true"
    return Assumptions().with_updates(updates).with_updates(flagged, via_flags=True)


def build_inputs(args: argparse.Namespace):
    from dsaserve.config import load_config
    from dsaserve.ledger.deployment import Deployment, Workload
    from dsaserve.ledger.inputs import LedgerInputs

    work = Workload(kv_layout=args.kv_layout, context=parse_tokens(args.context, "--context"), batch=args.batch,
                    decode_context=parse_tokens(args.decode_context, "--decode-context"),
                    chunk=parse_tokens(args.chunk, "--chunk"), prompt=parse_tokens(args.prompt, "--prompt"),
                    prefix_hit=0 if str(args.prefix_hit) == "0" else parse_tokens(args.prefix_hit, "--prefix-hit"))
    dep = Deployment(tp=args.tp, ep=args.ep, dp_attention=args.dp_attention, pd=args.pd, n_gpus=args.gpus)
    return LedgerInputs(load_config(args.model), dep, _hardware(args), work, _assumptions(args))


def _reconcile(args: argparse.Namespace):
    from dsaserve.ledger.reconcile import load_run
    from dsaserve.ledger.sections_reconcile import reconcile_report

    if args.reconcile:
        run = load_run(args.reconcile)
    else:
        from dsaserve.cli.reconcile_driver import run_engine

        if args.kv_layout not in ENGINE_KV_LAYOUTS:
            raise ValueError(f"--kv-layout: the engine's pool has no {args.kv_layout!r} layout "
                             f"({', '.join(ENGINE_KV_LAYOUTS)}); reconcile a saved run instead")
        e = engine_run_settings(args)
        lens = tuple(parse_tokens(x, "--reconcile-prompts") for x in e["reconcile_prompts"].split(","))
        run = run_engine(e["reconcile_model"], lens, e["reconcile_max_tokens"], kv_layout=args.kv_layout,
                         device=e["reconcile_device"])
        if args.save_run:
            import json

            try:
                Path(args.save_run).write_text(json.dumps(run.to_dict(), indent=1, default=str))
            except OSError as e:
                raise _os_error("--save-run", args.save_run, e) from None
    return reconcile_report(run)


def render(report, args: argparse.Namespace) -> str:
    if args.json:
        from dsaserve.ledger.render import to_json

        return to_json(report) + "\n"
    if args.markdown:
        from dsaserve.ledger.render.markdown import render_markdown

        return render_markdown(report)
    from dsaserve.ledger.render.text import render_text

    return render_text(report)


def _writable_dir(flag: str, d: Path) -> None:
    if not d.is_dir():
        raise ValueError(f"{flag}: " + (f"{d} is not a directory" if d.exists() else f"directory {d} does not exist"))
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"{flag}: directory {d} is not writable")


def check_file(flag: str, path: str) -> None:
    """FILE can be written: not a directory, in an existing writable directory (or itself writable)."""
    p = Path(path).absolute()
    if p.is_dir():
        raise ValueError(f"{flag}: {p} is a directory")
    if p.exists():
        if not os.access(p, os.W_OK):
            raise ValueError(f"{flag}: {p} is not writable")
        return
    _writable_dir(flag, p.parent)


def check_dir(flag: str, path: str) -> None:
    """DIR is a writable directory or can be made in its nearest existing ancestor."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    _writable_dir(flag, p)


def engine_run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine run's flags with their defaults (`ENGINE_RUN`) where not given."""
    return {k: default if getattr(args, k) is None else getattr(args, k) for k, default in ENGINE_RUN.items()}


def check_outputs(args: argparse.Namespace) -> None:
    """Every path the command will write, checked before any work (a run of the engine may take minutes); the
    engine run's flags only where the engine runs."""
    for name in (*ENGINE_RUN, "save_run"):
        if getattr(args, name) is not None:
            _needs_engine_run(f"--{name.replace('_', '-')}", args)
    if args.out:
        check_file("--out", args.out)
    if args.plot:
        check_dir("--plot", args.plot)
    if args.save_run:
        check_file("--save-run", args.save_run)


def _needs_engine_run(flag: str, args: argparse.Namespace) -> None:
    """A flag of the engine run given where none runs: None, no --reconcile; a path, the run is that file."""
    if args.reconcile != "":
        why = "without --reconcile nothing runs" if args.reconcile is None else \
            f"--reconcile {args.reconcile} reads a saved run"
        raise ValueError(f"{flag}: only with --reconcile and no RUN.json, which runs the engine; {why}")


def _os_error(flag: str, path: str, e: OSError) -> ValueError:
    return ValueError(f"{flag}: cannot write {path}: {e.strerror or e}")


def write_outputs(report, args: argparse.Namespace) -> None:
    """The report to --out or stdout, then the plots; a path the checks passed can still fail (procfs, a full
    disk): the plot directory is made before the report is printed, so such a failure prints nothing."""
    text = render(report, args)
    if args.json or args.out:  # the text report carries them in its header, where a reader of the terminal sees it
        for w in report.warnings:
            print(f"dsaserve ledger: warning: {w['message']}", file=sys.stderr)
    try:
        if args.plot:
            Path(args.plot).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _os_error("--plot", args.plot, e) from None
    if not args.out:
        sys.stdout.write(text)
    else:
        try:
            Path(args.out).write_text(text)
        except OSError as e:
            raise _os_error("--out", args.out, e) from None
    if args.plot:
        from dsaserve.ledger.render.plots import write_plots

        try:
            paths = write_plots(report, args.plot)
        except OSError as e:
            raise _os_error("--plot", args.plot, e) from None
        for path in paths:
            print(f"wrote {path}", file=sys.stderr)


def build(args: argparse.Namespace):
    if args.measured is not None:
        if args.reconcile is not None:
            raise ValueError("--measured: one report at a time, not with --reconcile")
        from dsaserve.ledger.measured import load_measured
        from dsaserve.ledger.sections_measured import measured_report

        return measured_report(load_measured(args.measured),
                               (args.batch, parse_tokens(args.decode_context, "--decode-context")))
    if args.reconcile is not None:
        return _reconcile(args)
    from dsaserve.ledger.build import build_report

    sections = [s.strip() for s in args.sections.split(",") if s.strip()] if args.sections else None
    return build_report(build_inputs(args), sections, args.notes)


def main(args: argparse.Namespace) -> int:
    try:
        check_outputs(args)
        report = build(args)
        write_outputs(report, args)
    except ValueError as e:
        print(f"dsaserve ledger: error: {e}", file=sys.stderr)
        return 2
    if report.has("reconcile"):
        return 0 if all(r["ok"] is not False for r in report.section("reconcile").rows) else 1
    return 0
