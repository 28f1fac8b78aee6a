"""Prefill staging (issue 17): sparse MLA over a prefill's context rows dequantised once to bf16
(`kernels/triton_kv_stage.py`, `model/layers/prefill_staging.py`) against the fp8_ds_mla kernel reading the cache
itself, at GLM-5.3's shapes (64 heads, kv_lora 512 + rope 64, top-2048), per (tokens, context) case.

Run on the device (~40 s on an H200):  PYTHONPATH=. python bench/bench_prefill_staging.py --out DIR
The warp-specialised kernel's A/B (gluon_sparse_mla_ws.CANDIDATES, "ws:NAME" beside the default, the five cases
it is tuned on, each config timed --repeat times interleaved and its median kept):
  PYTHONPATH=. python bench/bench_prefill_staging.py --out DIR --ws-variants --repeat 3
Each case places one request's context on scattered pages of a larger pool, gives every token a causal top-k of
its context (the indexer's shape: a token at position p sees min(2048, p + 1) keys, -1 after), checks that the
staging is bit-exact against the reference ops and that sparse MLA over it matches the fp8 kernel, and times
(triton.testing.do_bench) the fp8 kernel, the staging and the remap, and sparse MLA over the staged rows in
several kernels and tilings (the Gluon kernel, the default on sm_90, and the Triton one): TFLOP/s over the valid
keys and the ratio to the fp8 kernel, with the staging counted and not.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from triton.testing import do_bench

from dsaserve.common.kv_layout import encode_latent, get_kv_layout
from dsaserve.kernels import gluon_sparse_mla as G
from dsaserve.kernels import gluon_sparse_mla_ws as W
from dsaserve.kernels import reference as R
from dsaserve.kernels import triton_kv_stage as K
from dsaserve.kernels import triton_sparse_mla as S

H, DC, DR, TOPK, PS = 64, 512, 64, 2048, 64
FP8, BF16 = get_kv_layout("fp8_ds_mla"), get_kv_layout("bf16")
CONFIGS = {  # sparse MLA over bf16 rows: {} is the dispatcher's default (the warp-specialised Gluon kernel on sm_90)
    "default": {},
    "triton": {"num_stages": 2, "block_k": 64, "prefetch": False},  # the Triton kernel the dispatcher ran before
    "triton-1stage": {"num_stages": 1, "block_k": 64, "prefetch": True},
    "gluon-single": {"gluon": {"ws": False}},  # the single-partition Gluon kernel (the default before the ws one)
    "fp8-gluon": {"gluon": {"ws": False}, "fp8": True},  # the cache itself, no staging: single partition
    "fp8-ws": {"gluon": {"ws": True, "ws_variant": {"PIN": True}}, "fp8": True},  # warp-specialised (PIN)
    "gluon-bk32-3stage": {"gluon": {"block_k": 32, "num_stages": 3, "ws": False}},  # single-partition tilings
    "gluon-bk64-1stage": {"gluon": {"block_k": 64, "num_stages": 1, "ws": False}},
}
# the warp-specialised kernel's switches beside "default" (its DEFAULT_SWITCHES at these sizes; "ws:ws" is the
# schedule before them)
WS_CONFIGS = {f"ws:{name}": {"gluon": {"ws": True, "ws_variant": switches}} for name, switches in W.CANDIDATES.items()}
WS_CASES = ((4096, 4096), (8192, 8192), (16384, 16384), (4096, 32768), (512, 8192))
CASES = ((4096, 4096), (8192, 8192), (16384, 16384), (4096, 32768), (1024, 1024), (512, 8192), (256, 256),
         (128, 8192), (128, 1024), (64, 8192), (32, 8192), (16, 8192))


def make_case(t: int, ctx: int, pool_pages: int, dev: str = "cuda"):
    """(cache, request pages, page map, top-k slots) of one request whose `ctx` rows sit on scattered pages."""
    torch.manual_seed(0)
    npages = ctx // PS
    pages = torch.randperm(pool_pages, device=dev)[:npages].to(torch.int32)
    cache = torch.zeros(pool_pages * PS, DC + 4 * (DC // 128) + 2 * DR, dtype=torch.uint8, device=dev)
    rows = (pages.long()[:, None] * PS + torch.arange(PS, device=dev)).reshape(-1)
    cache[rows] = encode_latent(torch.randn(npages * PS, DC + DR, device=dev), FP8, DC)
    pos = torch.arange(ctx - t, ctx, device=dev)
    score = torch.rand(t, ctx, device=dev).masked_fill(torch.arange(ctx, device=dev)[None, :] > pos[:, None], -1.0)
    val, idx = score.topk(min(TOPK, ctx), dim=1)
    slots = torch.where(val >= 0, pages.long()[idx // PS] * PS + idx % PS, -1).to(torch.int32)
    if slots.shape[1] < TOPK:
        slots = torch.cat([slots, torch.full((t, TOPK - slots.shape[1]), -1, dtype=torch.int32, device=dev)], 1)
    page_map = torch.full((pool_pages,), -1, dtype=torch.int32, device=dev)
    page_map[pages.long()] = torch.arange(npages, dtype=torch.int32, device=dev)
    return cache, pages, page_map, slots


def run_case(t: int, ctx: int, configs: dict = CONFIGS, repeat: int = 1) -> dict:
    cache, pages, page_map, slots = make_case(t, ctx, max(8192, 2 * ctx // PS))
    flop = 2.0 * H * (2 * DC + DR) * int((slots >= 0).sum())
    qn = torch.randn(t, H, DC, device="cuda", dtype=torch.bfloat16)
    qr = torch.randn(t, H, DR, device="cuda", dtype=torch.bfloat16)
    staged = torch.empty(pages.numel() * PS, DC + DR, dtype=torch.bfloat16, device="cuda")
    K.stage_latent(cache, FP8, pages, PS, DC, staged)
    remapped = K.remap_slots(slots, page_map, PS)
    fp8_triton = {"grouped": "dequant"}  # the Triton fp8 kernel as the dispatcher ran it before the Gluon one
    ref = S.sparse_mla_attention(qn, qr, cache, FP8, slots, 0.04, DC, config=fp8_triton)
    res = {"tokens": t, "context": ctx,
           "stage_exact": torch.equal(staged, R.stage_latent(cache, FP8, pages, PS, DC, torch.empty_like(staged))),
           "remap_exact": torch.equal(remapped, R.remap_slots(slots, page_map, PS))}
    fp8_ms = do_bench(lambda: S.sparse_mla_attention(qn, qr, cache, FP8, slots, 0.04, DC, config=fp8_triton),
                      warmup=10, rep=60)
    res.update(fp8_ms=round(fp8_ms, 4), fp8_tflops=round(flop / fp8_ms / 1e9, 1),
               stage_ms=round(do_bench(lambda: K.stage_latent(cache, FP8, pages, PS, DC, staged), rep=40), 4),
               remap_ms=round(do_bench(lambda: K.remap_slots(slots, page_map, PS), rep=40), 4))
    rows = staged.view(torch.uint8)
    times: dict[str, list[float]] = {name: [] for name in configs}
    outs = {}
    for name, cfg in list(configs.items()) * repeat:  # interleaved: a drift of the clocks hits every config alike
        def call(cfg=cfg):
            if "fp8" in cfg:
                return G.sparse_mla_attention_gluon(qn, qr, cache, slots, 0.04, torch.empty_like(qn), cfg["gluon"])
            if "gluon" in cfg:
                return G.sparse_mla_attention_gluon(qn, qr, staged, remapped, 0.04, torch.empty_like(qn), cfg["gluon"])
            if not cfg:  # the registry's op (the Gluon kernel on sm_90)
                return G.sparse_mla_attention(qn, qr, rows, BF16, remapped, 0.04, DC)
            return S.sparse_mla_attention(qn, qr, rows, BF16, remapped, 0.04, DC, config=dict(cfg))
        if name not in outs:
            outs[name] = call()
        times[name].append(do_bench(call, warmup=10, rep=60))
    for name, ms_all in times.items():
        ms, out = sorted(ms_all)[len(ms_all) // 2], outs[name]
        res[name] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1), "x_fp8": round(fp8_ms / ms, 3),
                     "ms_all": [round(x, 4) for x in ms_all],
                     "x_fp8_with_staging": round(fp8_ms / (ms + res["stage_ms"] + res["remap_ms"]), 3),
                     "max_rel_diff": float((out.float() - ref.float()).abs().max() / ref.float().abs().max())}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ws-variants", action="store_true",
                    help="the warp-specialised kernel's A/B: default, gluon-single and WS_CONFIGS on WS_CASES")
    ap.add_argument("--repeat", type=int, default=1, help="timings of each config, interleaved (the median kept)")
    args = ap.parse_args()
    rows = []
    Path(args.out).mkdir(parents=True, exist_ok=True)
    configs = CONFIGS
    if args.ws_variants:
        configs = {"default": {}, "gluon-single": CONFIGS["gluon-single"], **WS_CONFIGS}
    name = "prefill_staging_ws_variants.json" if args.ws_variants else "prefill_staging.json"
    for t, ctx in WS_CASES if args.ws_variants else CASES:
        rows.append(run_case(t, ctx, configs, args.repeat))
        r = rows[-1]
        print(f"T={t:6d} ctx={ctx:6d} fp8 {r['fp8_ms']:.3f} ms {r['fp8_tflops']:6.1f} TFLOP/s | staging "
              f"{r['stage_ms'] * 1e3:.0f}+{r['remap_ms'] * 1e3:.0f} us | default bf16 {r['default']['tflops']:6.1f} "
              f"TFLOP/s = {r['default']['x_fp8']:.3f}x ({r['default']['x_fp8_with_staging']:.3f}x with the staging)",
              flush=True)
        print("   ", " ".join(f"{n} {r[n]['tflops']} (rel {r[n]['max_rel_diff']:.1e})" for n in configs), flush=True)
        if args.ws_variants:  # each variant beside the default, and its spread over the repeats
            for n in WS_CONFIGS:
                spread = [round(r[n]["tflops"] * r[n]["ms"] / x, 1) for x in r[n]["ms_all"]]
                print(f"      {n:24s} {r[n]['tflops']:6.1f} TFLOP/s = {r[n]['tflops'] / r['default']['tflops']:.3f}x "
                      f"default (repeats {spread})", flush=True)
        (Path(args.out) / name).write_text(json.dumps(rows, indent=1))  # each case, in case of a kill
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
