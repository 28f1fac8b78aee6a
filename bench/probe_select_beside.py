"""How one long row's fused indexer selection runs beside the q path's GEMV (issue 17: the batch-1 32K step).

In a batch-1 step at 32K a full layer's selection (`triton_indexer_coop.coop_score_select`: one row, 64 programs of
512 keys, or 128 of 256) runs on the side stream beside q_b (an FP8 GEMV, N 12288 x K 2048 at GLM-5.3) and the
rest of the q path; in the step it lasts ~31 µs where alone it takes ~17-20 µs. This times, each as one CUDA graph
of `--calls` calls (each over its own pages and its own weight copy, so keys and weights come from HBM):
the selection alone, q_b's and the indexer's wq_b's GEMV alone, each forked beside the selection onto two streams
(the selection captured first, as the model does, and the GEMV first) and both on one stream one after the other;
then the q path (q_b, W_uk's head GEMM) alone and beside the selection. If "beside" is near the longer one alone,
the overlap is free; near the sum, the two share something (SMs' slots, issue, HBM) the step pays for (forty-fourth
session, H100: the selection 20.4 µs and the q path 18.3 alone, 31.2 beside).

Run on the device:  PYTHONPATH=. python bench/probe_select_beside.py --out DIR   (~15 s; --select-only: the
selection alone at 512- and 256-key chunks, which also runs on older trees)
Writes probe_select_beside.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.sweep_decode_b1 import graph_us, indexer_case
from dsaserve.common.kv_layout import get_kv_layout
from dsaserve.kernels import triton_indexer_coop
from dsaserve.kernels.triton_fp8_gemm import attach_fp8, fp8_linear, quant_act_fp8
from dsaserve.kernels.triton_head_gemm import head_bmm

FP8 = get_kv_layout("fp8_ds_mla")
PS, IH, IDIM, TOPK = 64, 32, 128, 2048


def _selection(calls: int, keys: int):
    """(select(i, chunk)) over `calls` sets of pages of one row of `keys` keys."""
    q, w, cache, tables, req, pos = indexer_case(calls, 1, keys, PS, IH, IDIM)
    out = torch.empty(1, TOPK, dtype=torch.int64, device="cuda")

    def select(i: int, chunk: int) -> None:
        triton_indexer_coop.coop_score_select(q[i], w[i], cache, tables[i], req, pos, out, TOPK, PS, chunk)
    return select


def _gemv(calls: int, n: int, k: int):
    """(gemv(i)) of one token through `calls` FP8 weight copies [n, k] with 128 x 128 block scales."""
    weights = (torch.randn(calls, n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
    scales = torch.rand(calls, n // 128, k // 128, device="cuda") * 0.01
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    x = attach_fp8(x, *quant_act_fp8(x))  # as the step's RMSNorm leaves it: no quantiser launch before the GEMV
    return lambda i: fp8_linear(x, weights[i], scales[i])


def _q_path(calls: int):
    """(q_path(i)): q_b's GEMV (N 12288 = 64 heads x 192, K 2048) then W_uk's head GEMM ([1, 64, 192] x
    [64, 192, 512]), the q path a full layer's selection runs beside."""
    gemv = _gemv(calls, 12288, 2048)
    w_uk = torch.randn(calls, 64, 192, 512, device="cuda", dtype=torch.bfloat16)

    def run(i: int) -> None:
        head_bmm(gemv(i).view(1, 64, 192), w_uk[i])
    return run


def _forked(first, second):
    """Run first on a side stream and second on the current one (captured in this order), then join."""
    side = torch.cuda.Stream(priority=-1)

    def run(i: int) -> None:
        side.wait_stream(torch.cuda.current_stream())
        if first[1]:
            with torch.cuda.stream(side):
                first[0](i)
            second[0](i)
        else:
            second[0](i)
            with torch.cuda.stream(side):
                first[0](i)
        torch.cuda.current_stream().wait_stream(side)
    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe-out")
    ap.add_argument("--calls", type=int, default=8)
    ap.add_argument("--keys", type=int, default=32768 + 64)  # a "32K" request: one page past 32,768 keys
    ap.add_argument("--select-only", action="store_true", help="the selection alone at each chunk, nothing beside")
    args = ap.parse_args()
    calls, rows = args.calls, []
    select = _selection(calls, args.keys)
    gemvs = {"q_b": _gemv(calls, 12288, 2048), "wq_b": _gemv(calls, 4096, 2048)}
    for chunk in (512, 256):
        if not triton_indexer_coop.coop_fits(1, -(-args.keys // chunk), torch.empty(0, device="cuda")):
            continue
        sel = (lambda i, c=chunk: select(i, c))
        row = {"keys": args.keys, "chunk": chunk, "select_alone_us": round(graph_us(sel, calls), 2)}
        for name, gemv in ({} if args.select_only else gemvs).items():
            row[f"{name}_alone_us"] = round(graph_us(gemv, calls), 2)
            row[f"{name}_beside_select_first_us"] = round(graph_us(_forked((sel, True), (gemv, None)), calls), 2)
            row[f"{name}_beside_gemv_first_us"] = round(graph_us(_forked((sel, False), (gemv, None)), calls), 2)
            row[f"{name}_then_select_us"] = round(graph_us(lambda i, g=gemv, s=sel: (g(i), s(i)), calls), 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if not args.select_only:
        sel, q_path = (lambda i: select(i, 512)), _q_path(calls)
        row = {"q_path_alone_us": round(graph_us(q_path, calls), 2),
               "q_path_beside_select_us": round(graph_us(_forked((sel, True), (q_path, None)), calls), 2)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_select_beside.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
