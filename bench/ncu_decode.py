"""Decode kernels for Nsight Compute (issue 17): each launched twice on its own inputs, nothing else from the
dsaserve kernels, so `ncu --kernel-name regex:...` sees exactly these launches (the second of each is warm).

Run on the device:
  ncu --clock-control none --kernel-name regex:'^_(index_score|sparse_mla|combine_kernel|moe_|fp8_skinny)' \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats python bench/ncu_decode.py
The cases are the batch-1 step's items without bytes behind them (bench/RESULTS.md, nineteenth session): the
indexer's scores of one 128K-key row (the FEW_ROWS tile), sparse MLA at one token over 2048 valid slots and its
combine, one skinny FP8 GEMM (o_proj, M = 1); and batch 128's MoE (32 experts, routes over the first 12, as the
slice's dummy router sends them): the swap-AB kernel at its default block_m. `--cases splitk128,splitk64,
splitk128_oproj`: the split-K FP8 GEMM and cuBLAS's `_scaled_mm` on the same rows (forty-second session: with
`--kernel-name regex:'_fp8_splitk|nvjet' --section SourceCounters` and `ncu -i REP --page source --csv
--print-source sass`, each SASS instruction's stall samples).
"""

from __future__ import annotations

import argparse
import functools

import torch

from dsaserve.common.index_pages import pack_pages
from dsaserve.common.kv_layout import encode_index_k, encode_latent, get_kv_layout
from dsaserve.kernels import triton_fp8_gemm as G
from dsaserve.kernels import triton_indexer
from dsaserve.kernels import triton_moe as MOE
from dsaserve.kernels import triton_sparse_mla as tsm
from dsaserve.weights.fp8 import quantize_fp8_block

FP8 = get_kv_layout("fp8_ds_mla")


def _one_row(keys: int, ps: int, heads: int, dim: int) -> tuple:
    """(q, head weights, FP8 index cache, page table, req index, position) of one decode row that sees `keys` keys."""
    pages = keys // ps
    cache = pack_pages(encode_index_k(torch.randn(pages * ps, dim, device="cuda"), FP8), FP8, dim, ps)
    table = torch.randperm(pages, device="cuda").view(1, pages)
    req, pos = torch.zeros(1, dtype=torch.int64, device="cuda"), torch.full((1,), keys - 1, device="cuda")
    q = torch.randn(1, heads, dim, device="cuda", dtype=torch.bfloat16)
    return q, torch.rand(1, heads, device="cuda", dtype=torch.bfloat16), cache, table, req, pos


def indexer_scores(keys: int = 131072, ps: int = 64, heads: int = 32, dim: int = 128) -> None:
    q, w, cache, table, req, pos = _one_row(keys, ps, heads, dim)
    for _ in range(2):
        triton_indexer.index_scores(q, w, cache, FP8, table, req, pos, ps)


def sparse_mla(valid: int = 2048, heads: int = 64, dc: int = 512, dr: int = 64) -> None:
    cache = encode_latent(torch.randn(1 << 20, dc + dr, device="cuda"), FP8, dc)
    slots = torch.full((1, 2048), -1, dtype=torch.int64, device="cuda")
    slots[:, :valid] = torch.randint(0, 1 << 20, (1, valid), device="cuda")
    qn = torch.randn(1, heads, dc, device="cuda", dtype=torch.bfloat16)
    qr = torch.randn(1, heads, dr, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        tsm.sparse_mla_attention(qn, qr, cache, FP8, slots, 0.04, dc)


def skinny(n: int = 6144, k: int = 16384) -> None:
    w, s = quantize_fp8_block(torch.randn(n, k, device="cuda"))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        G.fp8_linear(x, w, s)


def moe_b128(t: int = 128, experts: int = 32, hot: int = 12, h: int = 6144, inter: int = 2048, k: int = 8) -> None:
    (w13, s13), (w2, s2) = (quantize_fp8_block(torch.randn(experts, 2 * inter, h, device="cuda") * 0.05),
                            quantize_fp8_block(torch.randn(experts, h, inter, device="cuda") * 0.05))
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(hot, device="cuda")[:k] for _ in range(t)])
    tw = torch.rand(t, k, device="cuda")
    for _ in range(2):
        MOE.fused_moe(x, w13, s13, w2, s2, tw, ids)


def splitk(m: int = 128, n: int = 2816, k: int = 6144, split: int = 1) -> None:
    """The split-K FP8 GEMM (`gluon_fp8_splitk`) and cuBLAS's `_scaled_mm` on the same quantised rows (qkv_a's
    shape by default: at 128 rows and split 1 its program took ~1.6x cuBLAS's time a K block until the forty-second
    session's samples pointed at the promotion, 1.1-1.2x since)."""
    from dsaserve.kernels import gluon_fp8_splitk as SK

    w, s = quantize_fp8_block(torch.randn(n, k, device="cuda"))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    a, a_s = G.quant_act_fp8(x, scale_m_major=True)
    pad, pad_s = G.quant_act_fp8(x, pad_m_to=16, scale_m_major=True)
    for _ in range(2):
        SK.fp8_splitk_gemm(a, a_s, w, s, split)
        torch._scaled_mm(pad, w.t(), scale_a=pad_s, scale_b=s.t(), out_dtype=torch.bfloat16)


def coop_select(keys: int = 32768 + 64, chunk: int = 512, ps: int = 64, heads: int = 32, dim: int = 128) -> None:
    """One decode row's fused score + cooperative select (`triton_indexer_coop.coop_score_select`) at a "32K" request's
    few-row class: 65 programs of 512 keys (forty-fourth session: where its ~20 µs go, by SASS line)."""
    from dsaserve.kernels import triton_indexer_coop

    q, w, cache, table, req, pos = _one_row(keys, ps, heads, dim)
    out = torch.empty(1, 2048, dtype=torch.int64, device="cuda")
    for _ in range(2):
        triton_indexer_coop.coop_score_select(q, w, cache, table, req, pos, out, 2048, ps, chunk)


CASES = {"indexer_scores": indexer_scores, "coop_select": coop_select, "sparse_mla": sparse_mla, "skinny": skinny,
         "moe_b128": moe_b128,
         "splitk128": splitk, "splitk64": functools.partial(splitk, m=64),
         "splitk128_oproj": functools.partial(splitk, n=6144, k=16384, split=2)}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="indexer_scores,sparse_mla,skinny,moe_b128",
                    help=f"comma-separated, of {', '.join(CASES)}")
    for case in ap.parse_args().cases.split(","):
        CASES[case]()
    torch.cuda.synchronize()
    print("ncu_decode: done")
