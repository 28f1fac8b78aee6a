"""Kernel benchmark (issue: the GPU fast path): every GPU op at GLM-5.3's per-layer shapes, beside the
roofline measured in the same run.

Run on the device:  PYTHONPATH=. python bench/bench_kernels.py --out $OUT [--sweep] [--only fp8,moe,...]
Ceilings measured first: device-to-device copy bandwidth (bytes read + written / time, 2 GiB) and dense
GEMM rates (bf16 8192^3; FP8 `_scaled_mm` 8192^3, tensor-wise scales). Each op is timed as CUDA-graph
replays (so launch gaps do not count, and capture itself proves the op graph-safe), median of `reps`;
where one call's data would sit in the 60 MB L2, the graph walks several independent copies of the
inputs and the time is per call. Bytes = what the op must move at least (weights/KV/index keys read once,
outputs written once); ratio = achieved / ceiling. Writes kernels.json and kernels.md under --out.
"""

# ruff: noqa: B023  (every lambda below is called at once by graph_time, inside its loop iteration)
from __future__ import annotations

import argparse
import json
import traceback
from pathlib import Path

import torch

from bench.bench_gpu import pipelined_time  # back to back, one sync: prefill ops build host tables (no graph)
from dsaserve.common.index_pages import key_views, pack_pages
from dsaserve.common.kv_layout import encode_index_k, encode_latent
from dsaserve.config import load_config
from dsaserve.kernels import reference as R
from dsaserve.kernels import triton_fp8_gemm as G
from dsaserve.kernels import triton_indexer as IDX
from dsaserve.kernels import triton_indexer_dispatch as DISPATCH
from dsaserve.kernels import triton_kv_write as KVW
from dsaserve.kernels import triton_moe as MOE
from dsaserve.kernels import triton_sparse_mla as MLA
from dsaserve.kernels import triton_sparse_mla_tc as MLA_TC
from dsaserve.kernels.cublaslt_tuning import graph_us
from dsaserve.weights.fp8 import quantize_fp8_block

L2_BYTES = 60 << 20
DEV = "cuda"
DECODE_T = (1, 8, 32, 128)  # decode batches (the 1/8/32/128)
CONTEXTS = (1024, 8192)  # decode context lengths (1K/8K)
LINEAR_M = (1, 8, 32, 64, 128)  # 128 crosses into the _scaled_mm path
PREFILL_M = (4096, 8192)
PREFILL_T = 4096  # prefill tokens for MoE and sparse MLA
INDEXER_PREFILL = (2048, 8192)  # (new tokens, context) of one prefill chunk
FLASHMLA_TFLOPS = {"decode": 410.0, "prefill": 640.0}  # FlashMLA's sparse FP8 decode / prefill kernels, H800
PREFILL_MOE_SWEEP = False  # prefill MoE tile sweep (three 5 ms configs); its result is the default now
RESULTS: list[dict] = []


def graph_time(calls: list, reps: int = 20) -> float:
    """Median seconds per call of a CUDA graph that runs `calls` in order (warmed outside the capture first)."""
    return graph_us(calls, reps) / 1e6


def copies_for(nbytes: int, cap: int = 32) -> int:
    """Independent input sets so a graph's working set is 3x the L2."""
    return max(1, min(cap, -(-3 * L2_BYTES // max(nbytes, 1))))


def probe_start(out: Path) -> dict:
    """A probe's first steps: its output folder made, the run's ceilings measured and printed (TB/s, TFLOP/s)."""
    out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings()
    print({k: round(v / 1e12, 3) for k, v in ceilings.items()}, "(TB/s, TFLOP/s)", flush=True)
    return ceilings


def measure_ceilings() -> dict:
    n = 1 << 31  # bytes; float32 elements (a uint8 copy_ ran at 2.76 TB/s here, a float one near 4.2)
    bufs = [torch.randn(n // 4, device=DEV)]
    bufs.append(torch.empty_like(bufs[0]))
    copy = graph_time([lambda: bufs[1].copy_(bufs[0])])
    read = graph_time([lambda: bufs[0].sum()])  # a pure read: what a weight-streaming GEMV can reach
    bufs.clear()
    m = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    gemm = graph_time([lambda: m @ k], reps=10)
    one = torch.ones((), device=DEV)
    m8, k8 = m.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn).t()
    fp8 = graph_time([lambda: torch._scaled_mm(m8, k8, one, one, out_dtype=torch.bfloat16)], reps=10)
    return {"copy_Bps": 2 * n / copy, "read_Bps": n / read, "bf16_flops": 2 * 8192**3 / gemm,
            "fp8_flops": 2 * 8192**3 / fp8}


def record(op, case, impl, sec, nbytes=0.0, flops=0.0, bound="hbm", ceil=None, **extra):
    r = {"op": op, "case": case, "impl": impl, "us": sec * 1e6, "bytes": nbytes, "flops": flops,
         "TBps": nbytes / sec / 1e12, "TFLOPs": flops / sec / 1e12, "bound": bound, **extra}
    if ceil:
        r["ratio"] = (nbytes / sec / ceil["copy_Bps"]) if bound == "hbm" else (flops / sec / ceil[bound])
        if bound == "hbm":
            r["ratio_read"] = nbytes / sec / ceil["read_Bps"]
    RESULTS.append(r)
    print(f"{op:22s} {case:34s} {impl:22s} {r['us']:9.1f} us  {r['TBps']:6.2f} TB/s  {r['TFLOPs']:7.1f} TF/s"
          f"  ratio {r.get('ratio', float('nan')):.2f} read-ratio {r.get('ratio_read', float('nan')):.2f}", flush=True)
    return r


# ---- fp8_linear -------------------------------------------------------------------------------------
def linear_shapes(cfg) -> list[tuple[str, int, int]]:
    h, ql = cfg.hidden_size, cfg.q_lora_rank
    heads = cfg.num_attention_heads
    return [("q_a", ql, h), ("kv_a", cfg.kv_latent_dim, h), ("q_b", heads * cfg.qk_head_dim, ql),
            ("o_proj", h, heads * cfg.v_head_dim), ("idx_wq_b", cfg.index_n_heads * cfg.index_head_dim, ql),
            ("idx_wk", cfg.index_head_dim, h), ("dense_gate", cfg.intermediate_size, h),
            ("dense_down", h, cfg.intermediate_size), ("headline", 16384, 6144)]


def _weights(n, k, copies):
    w, s = quantize_fp8_block(torch.randn(n, k, device=DEV))
    return [(w.clone(), s.clone()) for _ in range(copies)]


def bench_fp8(cfg, ceil, sweep):
    for name, n, k in linear_shapes(cfg):
        wbytes = n * k + 4 * s_numel(n, k)
        ws = _weights(n, k, copies_for(wbytes, cap=64))
        for m in LINEAR_M:
            x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
            if m <= 32:  # the FP8-activation skinny kernel on every shape (decides the dispatch)
                conf = {"block_m": max(16, m), "block_n": 64, "num_warps": 4, "num_stages": 4}
                conf["split"] = G.skinny_config(max(m, 2), n, k, G._sm_count(x))["split"]
                t = graph_time([lambda w=w, s=s: G.skinny_gemm(x, w, s, False, out_dtype=torch.bfloat16, a_fp8=True,
                                                               **conf) for w, s in ws])
                record("fp8_linear", f"{name} {n}x{k} M={m}", "triton-swapAB fp8-act", t, wbytes + 2 * m * (n + k),
                       2 * m * n * k, "hbm", ceil)
            if m <= G.SMALL_M or (m <= G.SKINNY_MAX_M and not G.scaled_mm_ok(n, k, x.device)):
                impl = "triton-fma" if m == 1 else "triton-swapAB"
            else:
                impl = "quant+scaled_mm" if G.scaled_mm_ok(n, k, x.device) else "triton fp8-act"
            t = graph_time([lambda w=w, s=s: G.fp8_linear(x, w, s) for w, s in ws])
            record("fp8_linear", f"{name} {n}x{k} M={m}", impl, t, wbytes + 2 * m * (n + k), 2 * m * n * k, "hbm", ceil)
        if name == "headline":
            wb = ws[0][0].to(torch.bfloat16)
            wbs = [wb] + [wb.clone() for _ in range(1)]
            for m in (1, 32):
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                t = graph_time([lambda w=w: x @ w.t() for w in wbs])
                record("bf16 cuBLAS baseline", f"{name} {n}x{k} M={m}", "torch.matmul", t, 2 * n * k, 2 * m * n * k,
                       "hbm", ceil)
            for m in (1, 8, 16, 32, 64):
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                t = graph_time([lambda w=w, s=s: G.scaled_mm_linear(x, w, s, torch.bfloat16) for w, s in ws])
                record("fp8_linear", f"{name} {n}x{k} M={m}", "scaled_mm (forced)", t, wbytes, 2 * m * n * k,
                       "hbm", ceil)
            for m in PREFILL_M:
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                w, s = ws[0]
                t = graph_time([lambda: G.fp8_linear(x, w, s)], reps=10)
                record("fp8_linear", f"{name} {n}x{k} M={m}", "quant+scaled_mm", t, wbytes, 2 * m * n * k,
                       "fp8_flops", ceil)
            if sweep:
                sweep_skinny(ws, n, k, ceil)
        del ws


def s_numel(n, k):
    return -(-n // 128) * -(-k // 128)


def sweep_skinny(ws, n, k, ceil):
    wbytes = n * k + 4 * s_numel(n, k)
    cases = [(1, dict(fma=True, block_m=1, block_n=64, num_warps=8, num_stages=3))]
    cases += [(m, dict(fma=False, a_fp8=True, block_m=max(16, m), block_n=bn, num_warps=w, num_stages=st))
              for m in (1, 16, 64) for bn, w, st in ((64, 4, 6), (128, 4, 4), (32, 4, 6))]
    for m, conf in cases:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        try:
            t = graph_time([lambda w=w, s=s, c=conf: G.skinny_gemm(x, w, s, split=1, out_dtype=torch.bfloat16, **c)
                            for w, s in ws])
            tag = " ".join(f"{a}{b}" for a, b in conf.items() if a != "block_m")
            record("sweep skinny", f"{n}x{k} M={m} {tag}", "triton", t, wbytes, 2 * m * n * k, "hbm", ceil)
        except Exception as e:  # noqa: BLE001 - a config that does not fit shared memory is a data point
            print("sweep skinny failed", conf, repr(e)[:200])


# ---- fused MoE ----------------------------------------------------------------------------------------
def bench_moe(cfg, ceil, sweep):
    e, h, inter, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    w13, s13 = quantize_fp8_block(torch.randn(e, 2 * inter, h, device=DEV) * 0.05)
    w2, s2 = quantize_fp8_block(torch.randn(e, h, inter, device=DEV) * 0.05)
    per_expert = 3 * h * inter + 4 * (s13[0].numel() + s2[0].numel())
    bias = torch.zeros(e, device=DEV)
    for t in (*DECODE_T, PREFILL_T):
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
        logits = torch.randn(t, e, device=DEV)
        tw, ids = R.moe_route(logits, bias, k, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, True)
        touched = int(ids.unique().numel())
        nbytes = touched * per_expert + 4 * t * h
        flops = 6.0 * t * k * h * inter
        bound = "hbm" if t <= 128 else "fp8_flops"
        impl = "triton fp8-act " + ("A-operand" if t * k >= MOE.PREFILL_MIN_PAIRS else
                                    "swap-AB, unsorted" if t * k <= MOE.UNSORTED_MAX_PAIRS else "swap-AB")
        sec = graph_time([lambda: MOE.fused_moe(x, w13, s13, w2, s2, tw, ids)], reps=10 if t > 128 else 20)
        record("fused_moe", f"E{e} H{h} I{inter} top{k} T={t} ({touched} experts)", impl, sec, nbytes, flops, bound,
               ceil)
        if t in (DECODE_T[0], DECODE_T[-1]):
            sec = graph_time([lambda: R.moe_route(logits, bias, k, cfg.n_group, cfg.topk_group,
                                                   cfg.routed_scaling_factor, True)] * 16)
            record("moe_route", f"E{e} top{k} T={t}", "torch ops", sec, 4 * t * e, 0, "hbm", ceil)
        if sweep and t in DECODE_T[::2] + DECODE_T[-1:]:
            for bn, st, wp, sw, f8 in ((64, 4, 4, "swap", True), (128, 4, 4, "swap", True), (32, 4, 4, "gemm", False),
                                       (64, 4, 4, "unsorted", True)):
                conf = {"block_n": bn, "num_stages": st, "num_warps": wp, "kernel": sw, "fp8_act": f8}
                try:
                    sec = graph_time([lambda: MOE.fused_moe(x, w13, s13, w2, s2, tw, ids, config=conf)])
                    record("sweep moe", f"T={t} bn{bn} st{st} w{wp} {sw} fp8act{f8}", "triton", sec, nbytes, flops,
                           "hbm", ceil)
                except Exception as ex:  # noqa: BLE001
                    print("sweep moe failed", conf, repr(ex)[:200])
    if sweep and PREFILL_MOE_SWEEP:  # swept on 2026-11-29 (bench/RESULTS.md): 64x64, 4 warps, 4 stages kept
        t = PREFILL_T
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
        tw, ids = R.moe_route(torch.randn(t, e, device=DEV), bias, k, 1, 1, 2.5, True)
        for conf in ({"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 3},
                     {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 3},
                     {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 4}):
            try:
                sec = graph_time([lambda c=conf: MOE.fused_moe(x, w13, s13, w2, s2, tw, ids, config=c)], reps=5)
                record("sweep moe", f"T={t} " + " ".join(f"{a}{b}" for a, b in conf.items()), "triton fp8-act", sec,
                       0, 6.0 * t * k * h * inter, "fp8_flops", ceil)
            except Exception as ex:  # noqa: BLE001
                print("sweep moe failed", conf, repr(ex)[:200])


# ---- indexer --------------------------------------------------------------------------------------------
def _indexer_inputs(t, ctx, cfg, ps=64, one_request=False):
    hi, d = cfg.index_n_heads, cfg.index_head_dim
    n_req = 1 if one_request else t
    pages = -(-ctx // ps)
    cache = pack_pages(encode_index_k(torch.randn(n_req * pages * ps, d, device=DEV), "fp8_ds_mla"), "fp8_ds_mla", d,
                       ps)
    table = torch.randperm(n_req * pages, device=DEV).view(n_req, pages)
    if one_request:
        req = torch.zeros(t, dtype=torch.int64, device=DEV)
        pos = torch.arange(ctx - t, ctx, device=DEV)
    else:
        req = torch.arange(t, device=DEV)
        pos = torch.full((t,), ctx - 1, device=DEV)
    q = torch.randn(t, hi, d, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(t, hi, device=DEV) * (hi ** -0.5 * d ** -0.5)
    return q, w, cache, table, req, pos


def bench_indexer(cfg, ceil, sweep):
    topk = cfg.index_topk
    for ctx in CONTEXTS:
        for t in DECODE_T:
            nbytes = t * ctx * 132
            sets = [_indexer_inputs(t, ctx, cfg) for _ in range(copies_for(nbytes, cap=64))]
            sec = graph_time([lambda a=a: IDX.indexer_topk(a[0], a[1], a[2], "fp8_ds_mla", a[3], a[4], a[5], topk, 64)
                              for a in sets])
            record("indexer_topk", f"T={t} ctx={ctx}", "triton scores + topk", sec, nbytes, 0, "hbm", ceil)
            sec = graph_time([lambda a=a: IDX.index_scores(a[0], a[1], a[2], "fp8_ds_mla", a[3], a[4], a[5], 64)
                              for a in sets])
            record("indexer scores only", f"T={t} ctx={ctx}", "triton", sec, nbytes, 0, "hbm", ceil)
            del sets
    t, ctx = INDEXER_PREFILL  # a prefill chunk: the last t tokens of a ctx-token prompt
    a = _indexer_inputs(t, ctx, cfg, one_request=True)
    flops = 2.0 * t * ctx * cfg.index_n_heads * cfg.index_head_dim
    sec = graph_time([lambda: IDX.indexer_topk(a[0], a[1], a[2], "fp8_ds_mla", a[3], a[4], a[5], topk, 64)], reps=10)
    record("indexer_topk", f"prefill T={t} ctx={ctx}", "triton scores + topk", sec, 0, flops, "bf16_flops", ceil)
    sec = graph_time([lambda: IDX.index_scores(a[0], a[1], a[2], "fp8_ds_mla", a[3], a[4], a[5], 64)], reps=10)
    record("indexer scores only", f"prefill T={t} ctx={ctx}", "triton", sec, 0, flops, "bf16_flops", ceil)


# ---- indexer at prefill and long-context decode (issue 17) ---------------------------------------------
PREFILL_CHUNK = 8192  # tokens of one prefill chunk: the last 8K tokens of an 8K / 32K prompt
PREFILL_CTX = (8192, 32768)
LONG_CONTEXTS = (32768, 131072, 202752)  # decode rows past the one-program selection, to the model's max
H200_HBM_Bps = 4.25e12  # spec bandwidth: a decode row's bound is its FP8 keys (128 B / token) read once


def _deep_gemm_peer(q, w, cache, ctx, t):
    """DeepGEMM's fp8_mqa_logits (logits only, contiguous keys) on the same shape, when it is installed."""
    try:
        import deep_gemm
    except ImportError:
        return None
    keys, scales = key_views(cache, "fp8_ds_mla", 128)  # pages in position order: table[0] is arange
    k8 = keys.reshape(-1, 128)[:ctx].contiguous().view(torch.float8_e4m3fn)
    ks = scales.reshape(-1)[:ctx].contiguous()
    q8 = q.to(torch.float8_e4m3fn)
    ke = torch.arange(ctx - t + 1, ctx + 1, dtype=torch.int32, device=DEV)
    return pipelined_time(lambda: deep_gemm.fp8_mqa_logits(q8, (k8, ks), w, torch.zeros_like(ke), ke), steps=5)


def bench_indexer_prefill(cfg, ceil, sweep):
    from dsaserve.kernels import triton_indexer_prefill as PRE

    topk, t = cfg.index_topk, PREFILL_CHUNK
    confs = [(True, {}), (False, {})]
    if sweep:  # pipeline depth, fewer compactions (a 2x buffer), a 64-key tile
        confs += [(True, {"num_stages": 3}), (True, {"cap": 2 * PRE.capacity(topk)}), (True, {"bn": 64})]
    for ctx in PREFILL_CTX:
        q, w, cache, table, req, pos = _indexer_inputs(t, ctx, cfg, one_request=True)
        flops = 2.0 * cfg.index_n_heads * cfg.index_head_dim * sum(range(ctx - t + 1, ctx + 1))  # causal keys
        for q_fp8, conf in confs:
            try:
                sec = pipelined_time(lambda: PRE.prefill_topk(q, w, cache, "fp8_ds_mla", table, req, pos, topk, 64,
                                                              [ctx], [t], q_fp8=q_fp8, config=conf), steps=5)
                tag = f"triton {'fp8' if q_fp8 else 'fp16'}-q GEMM + stream top-k {conf or ''}"
                record("indexer prefill", f"T={t} ctx={ctx} top{topk}", tag, sec, 0, flops, "fp8_flops", ceil)
            except Exception as ex:  # noqa: BLE001 - a config that does not compile is a data point
                print("indexer prefill failed", conf, repr(ex)[:300])
        if ctx == PREFILL_CTX[0]:  # the path it replaces: [T, ctx] fp32 scores + torch.topk
            scores = lambda: IDX.index_scores(q, w, cache, "fp8_ds_mla", table, req, pos, 64)  # noqa: E731
            sec = pipelined_time(lambda: scores().topk(topk, dim=1), steps=5)
            record("indexer prefill", f"T={t} ctx={ctx} top{topk}", "old: triton scores + torch.topk", sec, 0, flops,
                   "fp8_flops", ceil)
        peer = _deep_gemm_peer(q, w, cache, ctx, t)
        if peer:
            record("indexer prefill", f"T={t} ctx={ctx}", "peer: deep_gemm.fp8_mqa_logits (logits only)", peer, 0,
                   flops, "fp8_flops", ceil)


def bench_indexer_long(cfg, ceil, sweep):
    from dsaserve.kernels import triton_indexer_long as LONG

    topk = cfg.index_topk
    for ctx in LONG_CONTEXTS:
        for t in (1, 8):
            keys = t * ctx * cfg.index_head_dim  # FP8 key bytes read
            bound = f"keys at 4.25 TB/s {keys / H200_HBM_Bps * 1e6:.1f} us"
            sets = [_indexer_inputs(t, ctx, cfg) for _ in range(copies_for(t * ctx * 132, cap=8))]
            sec = graph_time([lambda a=a: DISPATCH.indexer_topk(a[0], a[1], a[2], "fp8_ds_mla", a[3], a[4], a[5], topk,
                                                                64) for a in sets])
            record("indexer_topk decode", f"T={t} ctx={ctx} ({bound})", "triton scores + radix select", sec, keys, 0,
                   "hbm", ceil, x_hbm_bound=sec * H200_HBM_Bps / keys)
            a = sets[0]
            scores = IDX.index_scores(a[0], a[1], a[2], "fp8_ds_mla", a[3], a[4], a[5], 64, skip_below=topk)
            out = torch.empty(t, topk, dtype=torch.int64, device=DEV)
            sec = graph_time([lambda: LONG.long_row_select(scores, a[3], a[4], a[5], out, topk, 64)])
            record("indexer select only", f"T={t} ctx={ctx}", "triton radix, split over programs", sec, 0, 0, "hbm")
            if ctx == LONG_CONTEXTS[0]:  # the one-program path it replaces past 16K keys
                conf = IDX._select_config(ctx, t)
                sec = graph_time([lambda: IDX._topk_select_kernel[(t,)](
                    scores, a[3], a[4], a[5], out, ctx, topk, 64, scores.stride(0), a[3].stride(0), out.stride(0),
                    **conf)])
                record("indexer select only", f"T={t} ctx={ctx}", "old: one program per row over L2", sec, 0, 0, "hbm")
            del sets


# ---- sparse MLA ----------------------------------------------------------------------------------------
def _mla_inputs(t, ctx, cfg, topk, layout="fp8_ds_mla"):
    h, dc, dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    rows = t * ctx if t * ctx * 656 < (4 << 30) else 1 << 20
    cache = encode_latent(torch.randn(rows, dc + dr, device=DEV), layout, dc)
    valid = min(topk, ctx)
    slots = torch.randint(0, rows, (t, topk), device=DEV)
    slots[:, valid:] = -1
    qn = torch.randn(t, h, dc, device=DEV, dtype=torch.bfloat16)
    qr = torch.randn(t, h, dr, device=DEV, dtype=torch.bfloat16)
    return qn, qr, cache, slots, valid


def bench_mla(cfg, ceil, sweep):
    topk, h, dc, dr = cfg.index_topk, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    scale = (cfg.qk_head_dim) ** -0.5
    for ctx in CONTEXTS:
        for t in DECODE_T:
            nbytes = t * min(topk, ctx) * 656 + 2 * t * h * (2 * dc + dr)
            sets = [_mla_inputs(t, ctx, cfg, topk) for _ in range(copies_for(nbytes, cap=64))]
            sec = graph_time([lambda a=a: MLA.sparse_mla_attention(a[0], a[1], a[2], "fp8_ds_mla", a[3], scale, dc)
                              for a in sets])
            fl = MLA.flops(t, h, min(topk, ctx), dc, dr)
            record("sparse_mla", f"T={t} ctx={ctx} topk={topk}", "triton fp8_ds_mla", sec, nbytes, fl, "hbm", ceil)
            if sweep and ctx == CONTEXTS[-1] and t in DECODE_T[::2]:
                for conf in ({"block_h": 16, "grouped": False}, {"block_h": 64, "num_warps": 8, "block_k": 16}):
                    try:
                        sec = graph_time([lambda a=a, c=conf: MLA.sparse_mla_attention(
                            a[0], a[1], a[2], "fp8_ds_mla", a[3], scale, dc, config=c) for a in sets])
                        record("sweep mla", f"T={t} " + " ".join(f"{k}{v}" for k, v in conf.items()), "triton", sec,
                               nbytes, fl, "hbm", ceil)
                    except Exception as ex:  # noqa: BLE001
                        print("sweep mla failed", conf, repr(ex)[:200])
            del sets
    t = PREFILL_T
    a = _mla_inputs(t, CONTEXTS[-1], cfg, topk)
    fl = MLA.flops(t, h, topk, dc, dr)
    confs = [{}]
    if sweep:
        confs += [{"block_h": 64, "num_warps": 8, "num_stages": 3}]
    for conf in confs:
        try:
            sec = graph_time([lambda c=conf: MLA.sparse_mla_attention(a[0], a[1], a[2], "fp8_ds_mla", a[3], scale, dc,
                                                                      config=c)], reps=5)
            record("sparse_mla", f"prefill T={t} topk={topk} " + " ".join(f"{k}{v}" for k, v in conf.items()),
                   "triton fp8_ds_mla", sec, 0, fl, "bf16_flops", ceil)
        except Exception as ex:  # noqa: BLE001
            print("mla prefill failed", conf, repr(ex)[:200])
    bench_mla_tc(cfg, ceil)
    for layout in ("bf16",):
        t = DECODE_T[-2]
        b = _mla_inputs(t, CONTEXTS[-1], cfg, topk, layout)
        sec = graph_time([lambda: MLA.sparse_mla_attention(b[0], b[1], b[2], layout, b[3], scale, dc)])
        record("sparse_mla", f"T={t} ctx={CONTEXTS[-1]} topk={topk}", f"triton {layout}", sec,
               t * min(topk, CONTEXTS[-1]) * 2 * (dc + dr), 0, "hbm", ceil)


def bench_mla_tc(cfg, ceil):
    """The tensor-core kernel (issue 17) where the registry takes it (T >= 16), beside FlashMLA's figures; the
    ratio column reads its TFLOP/s against this run's bf16 GEMM (bench/sweep_sparse_mla_tc.py: its configs)."""
    topk, h, dc, dr = cfg.index_topk, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    scale = (cfg.qk_head_dim) ** -0.5
    for t in (32, 128, PREFILL_T):
        kind = "prefill" if t == PREFILL_T else "decode"
        nbytes = t * topk * 656 + 2 * t * h * (2 * dc + dr)
        sets = [_mla_inputs(t, CONTEXTS[-1], cfg, topk) for _ in range(copies_for(nbytes, cap=16))]
        sec = graph_time([lambda a=a: MLA_TC.sparse_mla_attention_tc(a[0], a[1], a[2], "fp8_ds_mla", a[3], scale, dc)
                          for a in sets], reps=5 if kind == "prefill" else 20)
        fl = MLA.flops(t, h, topk, dc, dr)
        ref = FLASHMLA_TFLOPS[kind]
        record("sparse_mla", f"{kind} T={t} topk={topk} (FlashMLA H800: {ref:.0f})", "triton tensor-core fp8_ds_mla",
               sec, nbytes, fl, "bf16_flops", ceil, flashmla_TFLOPs=ref, vs_flashmla=fl / sec / 1e12 / ref)
        del sets


# ---- KV writes ------------------------------------------------------------------------------------------
def bench_kv_write(cfg, ceil, sweep):
    dc, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    for t in (DECODE_T[0], DECODE_T[-1], PREFILL_M[-1]):
        cache = torch.zeros(max(t, 1024) * 2, 656, dtype=torch.uint8, device=DEV)
        slots = torch.randperm(cache.shape[0], device=DEV)[:t]
        kv_a = torch.randn(t, dc + dr, device=DEV, dtype=torch.bfloat16)
        w = torch.ones(dc, device=DEV, dtype=torch.bfloat16)
        ang = torch.rand(t, dr // 2, device=DEV)
        cos, sin = ang.cos(), ang.sin()
        reps = 32 if t < 1024 else 4  # one tiny launch would time the graph launch, not the kernel
        sec = graph_time([lambda: KVW.mla_kv_write(cache, "fp8_ds_mla", slots, kv_a, w, 1e-5, cos, sin, dc)] * reps)
        record("mla_kv_write", f"T={t}", "triton fused", sec, t * (2 * 576 * 2 + 656 + 8 * dr), 0, "hbm", ceil)
        icache = torch.zeros(cache.shape[0] // 64, 64 * 132, dtype=torch.uint8, device=DEV)  # pages of 64 slots
        k = torch.randn(t, 128, device=DEV, dtype=torch.bfloat16)
        sec = graph_time([lambda: KVW.indexer_k_write(icache, "fp8_ds_mla", slots, k)] * reps)
        record("indexer_k_write", f"T={t}", "triton", sec, t * (256 + 132), 0, "hbm", ceil)


SECTIONS = {"fp8": bench_fp8, "moe": bench_moe, "indexer": bench_indexer, "indexer_prefill": bench_indexer_prefill,
            "indexer_long": bench_indexer_long, "mla": bench_mla, "kvw": bench_kv_write}


def to_markdown(ceil: dict) -> str:
    lines = [f"Ceilings measured in this run: copy {ceil['copy_Bps'] / 1e12:.2f} TB/s (read+write), read-only "
             f"{ceil['read_Bps'] / 1e12:.2f} TB/s, bf16 GEMM "
             f"{ceil['bf16_flops'] / 1e12:.0f} TFLOP/s, FP8 GEMM {ceil['fp8_flops'] / 1e12:.0f} TFLOP/s.", "",
             "| op | case | impl | µs | TB/s | TFLOP/s | bound | achieved/ceiling | achieved/read-BW |",
             "|---|---|---|---:|---:|---:|---|---:|---:|"]
    for r in RESULTS:
        lines.append(f"| {r['op']} | {r['case']} | {r['impl']} | {r['us']:.1f} | {r['TBps']:.2f} | {r['TFLOPs']:.1f} | "
                     f"{r['bound']} | {r.get('ratio', float('nan')):.2f} | {r.get('ratio_read', float('nan')):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument("--config", default="glm-5.3-slice")
    args = ap.parse_args()
    cfg = load_config(args.config)
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print({k: f"{v / 1e12:.2f}e12" for k, v in ceil.items()}, flush=True)
    for name in args.only.split(","):
        try:
            SECTIONS[name](cfg, ceil, args.sweep)
        except Exception:  # noqa: BLE001 - one broken section must not cost the others' numbers
            traceback.print_exc()
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps({"ceilings": ceil, "results": RESULTS,
                                                       "device": torch.cuda.get_device_name()}, indent=1))
    (args.out / "kernels.md").write_text(to_markdown(ceil))


if __name__ == "__main__":
    main()
