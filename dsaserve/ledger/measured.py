"""Measured decode steps against the ledger: a GPU run's step times beside the ledger's bytes and bound for the same
model, layout, batch and context, and a time model fitted to them (`dsaserve ledger --measured RUN.json`).

Owns: `load_measured` (a `bench/bench_gpu.py` JSON: its decode rows, the copy rate it measured, the manifest's
model, parallel layout and KV layout; errors name the field), `measured_rows` (per row: the ledger's decode step at
the run's copy rate — its bytes by term and HBM bound — the run's own byte count, the measured step and its ratio
to the bound) and `fit_time` — step time = fixed + weight bytes / r_w + (KV + indexer) bytes / r_kv + requests x
per_request, fitted by least squares relative to each step's time with every term non-negative, and each row also
predicted from the others (leave one out): what a step costs on that GPU beyond its bytes (launches, gaps, the
sparse kernels' efficiency) as four numbers that price any batch and context the ledger models. Pure Python +
numpy; nothing runs on a device.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dsaserve.config import ModelConfig, load_config
from dsaserve.ledger.deployment import Assumptions, Deployment
from dsaserve.ledger.hardware import PRESETS, Hardware
from dsaserve.ledger.marginal import decode_step
from dsaserve.ledger.weights import inventory

FEATURES = ("fixed", "weights", "kv", "requests")  # the time model's terms, in `fit_time`'s column order


@dataclass(frozen=True)
class MeasuredRun:
    path: str
    cfg: ModelConfig
    dep: Deployment
    kv_layout: str
    copy_bw: float  # bytes/s the run measured for a device copy (the bound's rate)
    device: str
    rows: tuple[dict[str, Any], ...]  # the run's decode rows that ran: bs, ctx, step_ms, overlapped_ms, bytes


def _field(d: Any, path: str, typ: type | tuple[type, ...], where: str) -> Any:
    cur = d
    for key in path.split("."):
        if not isinstance(cur, dict) or key not in cur:
            raise ValueError(f"--measured {where}: no field {path!r}")
        cur = cur[key]
    if not isinstance(cur, typ) or isinstance(cur, bool):
        raise ValueError(f"--measured {where}: {path} is {cur!r}, not a {getattr(typ, '__name__', typ)}")
    return cur


def load_measured(path: str) -> MeasuredRun:
    """A bench_gpu run file; every field it needs checked, by name."""
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"--measured {path}: cannot read it: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--measured {path}: not JSON ({e})") from None
    m = _field(d, "manifest", dict, path)
    par = _field(m, "parallel", dict, path)
    dep = Deployment(tp=_field(par, "tp_size", int, path), ep=_field(par, "ep_size", int, path),
                     dp_attention=bool(par.get("dp_attention", False)))
    rows = []
    for i, r in enumerate(_field(d, "decode", list, path)):
        if isinstance(r, dict) and "skipped" in r:
            continue
        where = f"{path} decode[{i}]"
        for key in ("bs", "ctx"):
            if _field(r, key, int, where) < 1:
                raise ValueError(f"--measured {where}: {key} must be >= 1, got {r[key]}")
        for key in ("step_ms", "overlapped_ms"):
            if key in r or key == "step_ms":
                t = _field(r, key, (int, float), where)
                if not math.isfinite(t) or t <= 0:
                    raise ValueError(f"--measured {where}: {key} must be a positive time, got {t}")
        if "bytes" in r:
            _field(r, "bytes", dict, where)
        rows.append(r)
    if len(rows) < len(FEATURES) + 1:
        raise ValueError(f"--measured {path}: {len(rows)} decode rows ran; the time model needs at least "
                         f"{len(FEATURES) + 1}")
    return MeasuredRun(path, load_config(_field(m, "model", str, path)), dep,
                       _field(m, "kv_pool.layout", str, path), float(_field(d, "ceilings.copy_bytes_per_s",
                                                                             (int, float), path)),
                       str(d.get("device", "?")), tuple(rows))


RUN_ASSUMPTIONS = Assumptions(absorbed_heads="bf16")  # the GPU path holds the absorbed heads in bf16


def run_hardware(run: MeasuredRun) -> Hardware:
    """The H200 preset at the copy rate the run measured (the bound's rate)."""
    return PRESETS["h200"].with_overrides(hbm_bw=run.copy_bw)


def step_bytes(run: MeasuredRun, bs: int, ctx: int) -> tuple[float, float]:
    """(weight bytes, KV + indexer bytes) of the ledger's step for a row: the run's deployment, ctx + 1 keys a request
    (bench_gpu's rows decode at position ctx)."""
    st = decode_step(run.cfg, inventory(run.cfg), run.dep, run_hardware(run), RUN_ASSUMPTIONS, run.kv_layout, bs,
                     ctx + 1)
    return st.term("weights").bytes, st.term("kv").bytes + st.term("indexer").bytes


def predict(coef: np.ndarray, weights: float, kv: float, batch: int) -> float:
    """The fitted time model's step seconds."""
    return float(coef @ [1.0, weights, kv, batch])


def measured_rows(run: MeasuredRun) -> list[dict[str, Any]]:
    """Per decode row: the measured step (overlapped where the run has it), the ledger's bytes and bound."""
    out = []
    for r in run.rows:
        weights, kv = step_bytes(run, r["bs"], r["ctx"])
        t = float(r.get("overlapped_ms", r["step_ms"])) / 1e3
        hbm = weights + kv
        out.append({"batch": r["bs"], "context": r["ctx"], "measured_s": t, "weights": weights,
                    "kv": kv, "ledger_bytes": hbm, "run_bytes": (r.get("bytes") or {}).get("total"),
                    "bound_s": hbm / run.copy_bw, "ratio": t * run.copy_bw / hbm})
    return out


def _design(rows: list[dict[str, Any]]) -> np.ndarray:
    return np.array([[1.0, r["weights"], r["kv"], r["batch"]] for r in rows])  # FEATURES' order


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with non-negative coefficients, exactly: over every subset of the (four) terms, the unconstrained
    fit whose coefficients are all >= 0 with the least residual (the optimum is such a subset's fit)."""
    best, best_res = np.zeros(a.shape[1]), float(b @ b)
    for n in range(1, a.shape[1] + 1):
        for keep in itertools.combinations(range(a.shape[1]), n):
            sol = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
            if (sol < 0).any():
                continue
            coef = np.zeros(a.shape[1])
            coef[list(keep)] = sol
            res = float(np.sum((a @ coef - b) ** 2))
            if res < best_res - 1e-15 * max(best_res, 1.0):
                best, best_res = coef, res
    return best


def fit_time(rows: list[dict[str, Any]]) -> np.ndarray:
    """Coefficients of FEATURES (s, s/B, s/B, s/request) minimising the squared relative error of every row."""
    a, t = _design(rows), np.array([r["measured_s"] for r in rows])
    return _nnls(a / t[:, None], np.ones(len(rows)))


def predictions(rows: list[dict[str, Any]]) -> tuple[np.ndarray, list[float], list[float]]:
    """(the coefficients fitted on every row, each row's fitted time, each row's time fitted without it)."""
    coef = fit_time(rows)
    fitted = list(_design(rows) @ coef)
    loo = [predict(fit_time(rows[:i] + rows[i + 1:]), r["weights"], r["kv"], r["batch"]) for i, r in enumerate(rows)]
    return coef, fitted, loo
