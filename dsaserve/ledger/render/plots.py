"""PNG plots of a ledger `Report` (`dsaserve ledger --plot DIR`), drawn with matplotlib's Agg backend.

Owns: four figures read from the report's sections — per-chunk prefill time (prefill_chunks), the three
marginal-cost ledgers against context and against batch (marginal_vs_context / marginal_vs_batch), and
KV capacity against context (kv_capacity_vs_context). A section missing from the report skips its plot.
"""

from __future__ import annotations

from pathlib import Path

from dsaserve.ledger.report import Report

LEDGERS = (("comm_s", "communication"), ("weights_s", "weight read"), ("kv_s", "KV + indexer read"))


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def plot_prefill(report: Report, path: Path) -> Path:
    plt = _plt()
    sec = report.section("prefill_chunks")
    x = sec.column("chunk")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for key, label in (("lower_bound_s", "lower bound"), ("compute_s", "compute"), ("memory_s", "HBM"),
                       ("comm_s", "collectives")):
        ax.plot(x, [v * 1e3 for v in sec.column(key)], marker="." if key == "lower_bound_s" else None, label=label)
    ax.set(xlabel="chunk", ylabel="ms per chunk", title=sec.title)
    ax.legend()
    ax.grid(alpha=0.3)
    out = _save(fig, path)
    plt.close(fig)
    return out


def plot_marginal(report: Report, key: str, path: Path) -> Path:
    plt = _plt()
    sec = report.section(key)
    xkey = "context" if key.endswith("context") else "batch"
    x = sec.column(xkey)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for col, label in LEDGERS:
        ax.plot(x, [max(v, 1e-12) * 1e6 for v in sec.column(col)], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel=xkey + (" (tokens)" if xkey == "context" else ""),
           ylabel="us per generated token", title=sec.title)
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    out = _save(fig, path)
    plt.close(fig)
    return out


def plot_capacity(report: Report, path: Path) -> Path:
    plt = _plt()
    sec = report.section("kv_capacity_vs_context")
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot(sec.column("context"), sec.column("requests_fit"), marker="o")
    ax.set_yscale("symlog", linthresh=1)  # zero (does not fit) stays on the axis
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="requests that fit",
           title=f"{sec.title}: {report.model['name']}, {report.deployment['topology']}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3, which="both")
    out = _save(fig, path)
    plt.close(fig)
    return out


def write_plots(report: Report, out_dir: str | Path) -> list[Path]:
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    done = []
    if report.has("prefill_chunks"):
        done.append(plot_prefill(report, d / "prefill_chunks.png"))
    for key in ("marginal_vs_context", "marginal_vs_batch"):
        if report.has(key):
            done.append(plot_marginal(report, key, d / f"{key}.png"))
    if report.has("kv_capacity_vs_context"):
        done.append(plot_capacity(report, d / "kv_capacity_vs_context.png"))
    return done
