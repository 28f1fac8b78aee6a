"""What a batched decode step's indexer selection pays for its page table's width (issue 17).

A decode graph is captured at a page-table width class (`engine/decode_graphs.py`): batches of more than two rows
past the top-k replay max_model_len's class, so the score kernel's grid and the split select's are sized by that
width, not by the rows' positions. This times, each as one CUDA graph of `--calls` calls (each over its own pages,
so the keys come from HBM), `rows` rows at `ctx` keys each under page tables of the rows' own width, 128K and
GLM-5.3's 202,752 positions: the scores alone (`triton_indexer.index_scores`, as the long-row path calls it), the
split select alone over them (`triton_indexer_long.long_row_select`; with `--chunks` also at other chunk sizes)
and the whole selection (`triton_indexer_dispatch.indexer_topk`). Runs on older trees too (their score kernel has
no `fill`).

Run on the device:  PYTHONPATH=. python bench/probe_decode_width.py --out DIR   (~30 s)
Writes probe_decode_width.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import torch

from bench.sweep_decode_b1 import graph_us, indexer_case
from dsaserve.common.kv_layout import get_kv_layout
from dsaserve.kernels import triton_indexer, triton_indexer_dispatch, triton_indexer_long
from dsaserve.kernels.variants import core_width, long_select_chunk

FP8 = get_kv_layout("fp8_ds_mla")
PS, IH, IDIM, TOPK = 64, 32, 128, 2048


def _widened(tables: torch.Tensor, width: int) -> torch.Tensor:
    """The tables padded with page 0 to `width` pages (a wider class's columns past the rows' pages)."""
    out = torch.zeros(*tables.shape[:2], width, dtype=tables.dtype, device=tables.device)
    out[..., :tables.shape[2]] = tables
    return out


def measure(calls: int, rows: int, ctx: int, widths: list[int], chunks: list[int]) -> list[dict]:
    q, w, cache, tables, req, pos = indexer_case(calls, rows, ctx, PS, IH, IDIM)
    fill = {"fill": False} if "fill" in inspect.signature(triton_indexer.index_scores).parameters else {}
    out, res = torch.empty(rows, TOPK, dtype=torch.int64, device="cuda"), []
    for keys in widths:
        tab = _widened(tables, core_width(-(-keys // PS)))
        n_cols = tab.shape[2] * PS

        def scores(i: int, tab=tab) -> torch.Tensor:
            return triton_indexer.index_scores(q[i], w[i], cache, FP8, tab[i], req, pos, PS, skip_below=TOPK, **fill)

        made = [scores(i) for i in range(calls)]
        chunk = long_select_chunk(rows, n_cols)

        def select(i: int, tab=tab, made=made, chunk=chunk, **kw) -> None:  # chunk: the select's or another
            triton_indexer_long.long_row_select(made[i], tab[i], req, pos, out, TOPK, PS, chunk=chunk,
                                                late_slots=rows >= triton_indexer_long.LATE_SLOTS_ROWS, **kw)

        def whole(i: int, tab=tab) -> None:
            triton_indexer_dispatch.indexer_topk(q[i], w[i], cache, FP8, tab[i], req, pos, TOPK, PS)

        row = {"rows": rows, "ctx": ctx, "width_keys": n_cols, "fill_arg": bool(fill), "chunk": chunk,
               "scores_us": round(graph_us(scores, calls), 2), "select_us": round(graph_us(select, calls), 2),
               "whole_us": round(graph_us(whole, calls), 2)}
        for other in (c for c in chunks if c != chunk):
            row[f"select_{other}_us"] = round(graph_us(lambda i, c=other: select(i, chunk=c), calls), 2)
        print(json.dumps(row), flush=True)
        res.append(row)
        del made
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe-out")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--ctx", type=int, default=32768 + 64)  # a "32K" request: one page past 32,768 keys
    ap.add_argument("--widths", default="0,131136,202752", help="page-table widths in keys (0: the rows' own)")
    ap.add_argument("--chunks", default="", help="the split select also timed at these chunks (keys)")
    ap.add_argument("--ctxs", default="", help="more contexts after --ctx (keys)")
    args = ap.parse_args()
    rows = []
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    for r, ctx in ((r, c) for r in ints(args.rows) for c in [args.ctx, *ints(args.ctxs)]):
        widths = [w for w in (int(x) or ctx for x in args.widths.split(",")) if w >= ctx]
        rows += measure(args.calls, r, ctx, widths, ints(args.chunks))
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_decode_width.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
