"""Sweep of sparse MLA at batch-1/2 decode over the fp8_ds_mla cache (issue 17: the batch-1 targets).

At one or two tokens `triton_sparse_mla`'s split-K kernels run (one token: the generic kernel, 16 heads a
program; two: the 4-group kernel, 64 heads; splits by `pick_splits`), then their combine. This times each tile
config (heads / keys a program, warps, stages, slots a load of the valid-slot scan) at several split counts,
combine included, as serving runs them: inside one CUDA graph, `--calls` launches back to back, each over its
own random rows of a 1.4 GB pool (so the rows come from HBM, not L2) and its own query. Every output is checked
against the default config's.

Run on the device (~1-2 min on an H200):  PYTHONPATH=. python bench/sweep_decode_b1.py --out DIR
Writes sweep_decode_b1.json; prints each case's default beside its fastest config.
--indexer: instead the full layers' indexer at 1-2 rows past one program's reach (32K, 128K keys): the score
kernel's tiles (`triton_indexer_paged`: keys a tile, stages, tiles a program; each call over its own pages, so the
keys come from HBM) and the
split select's chunk size (`triton_indexer_long.long_row_select`, its scores in L2 as after the score kernel),
each output checked against the default's (8 calls a graph); and the score kernel + cooperative select against the
fused launch of both (`triton_indexer_coop.coop_score_select`) at each chunk that fits, each over its call's own
pages, the slots checked equal. Writes sweep_decode_b1_indexer.json.
The slots are int64, as the engine's selection writes them (the sixteenth session's runs used int32 slots: another
compiled variant of the same kernels).
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from bench.bench_long_select import _graph_time
from dsaserve.common.index_pages import pack_pages
from dsaserve.common.kv_layout import encode_index_k, encode_latent, get_kv_layout
from dsaserve.kernels import triton_indexer, triton_indexer_coop, triton_indexer_long
from dsaserve.kernels import triton_sparse_mla as tsm
from dsaserve.kernels import triton_sparse_mla_swap as swap
from dsaserve.kernels.variants import fused_select_chunk, long_select_chunk

H, DC, DR, TOPK = 64, 512, 64, 2048
FP8 = get_kv_layout("fp8_ds_mla")


def tile_configs() -> list[dict]:
    """The generic kernel's tiles (grouped False), the 4-group kernel's (the batch path's) and the swap-AB kernel
    (keys as the MMA's M, all 64 heads a program; `kernel` "swap"). scan 0: the top-k split statically, no scan
    of the valid slots before the first gather."""
    generic = [{"block_h": bh, "block_k": bk, "num_warps": w, "num_stages": st, "scan": sc, "grouped": False,
                "prefetch": False}
               for bh, bk, w, st, sc in itertools.product((16, 32), (32, 64), (4, 8), (1, 2), (0, 2048))]
    # 8 warps: at 1 warp a scheduler (4 warps) the program's chain is one warp's instructions (Nsight Compute,
    # twentieth session: 0.20 issued a cycle); 8 warps halve each warp's share, and the 16-head 32-key 4-group tile
    # then holds 251 registers without spilling (offline sm_90) where the shipped 4-warp generic tile spills
    grouped = [{"block_h": bh, "block_k": bk, "num_warps": w, "num_stages": 1, "scan": sc, "grouped": "dequant",
                "prefetch": False} for bh, bk, w in ((64, 64, 8), (32, 64, 4), (16, 64, 4), (16, 32, 8), (32, 32, 8),
                                                     (16, 64, 8)) for sc in (0, 2048)]
    swap_ab = [{"kernel": "swap", "block_k": bk, "num_warps": w} for bk, w in ((128, 8), (64, 4))]
    return generic + grouped + swap_ab


def graph_us(fn, calls: int, reps: int = 20) -> float:
    """µs a call: `calls` calls captured in one graph, replayed `reps` times."""
    return _graph_time(lambda: [fn(i) for i in range(calls)], reps) * 1e6 / calls


def indexer_case(calls: int, t: int, ctx: int, ps: int = 64, ih: int = 32, idim: int = 128) -> tuple:
    """(q, w, cache, tables [calls, t, pages], req, pos) of t decode rows at position ctx - 1 each, `calls` sets of
    their own pages (so a graph of `calls` calls reads its keys from HBM) and q / head weights, over the FP8 cache."""
    pages = -(-ctx // ps)
    cache = pack_pages(encode_index_k(torch.randn(calls * t * pages * ps, idim, device="cuda"), FP8), FP8, idim, ps)
    tables = torch.randperm(calls * t * pages, device="cuda").view(calls, t, pages)
    req, pos = torch.arange(t, device="cuda"), torch.full((t,), ctx - 1, device="cuda")
    q = torch.randn(calls, t, ih, idim, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(calls, t, ih, device="cuda", dtype=torch.bfloat16)
    return q, w, cache, tables, req, pos


def sweep_indexer(out_dir: Path, calls: int = 8, ps: int = 64, ih: int = 32, idim: int = 128) -> None:
    """The score kernel's tiles and the split select's chunk at 1-2 rows of 32K / 128K keys (module docstring)."""
    rows = []
    for t, ctx in itertools.product((1, 2), (32768, 131072)):
        q, w, cache, tables, req, pos = indexer_case(calls, t, ctx, ps, ih, idim)

        def scores(i, cfg, q=q, w=w, tables=tables, req=req, pos=pos, cache=cache):
            return triton_indexer.index_scores(q[i], w[i], cache, FP8, tables[i], req, pos, ps, tile=cfg)

        ref = scores(0, {}).clone()
        res = {"tokens": t, "keys": ctx, "scores_default_us": round(graph_us(lambda i: scores(i, {}), calls), 2),
               "scores": [], "select": []}
        # the page-major kernel's tiles (`triton_indexer_paged`): keys a tile, warps, stages, tiles a program
        for bs, st, blocks in itertools.product((64, 128), (3, 4), (None, 1, 2, 4, 8)):
            cfg = {"bs": bs, "num_warps": bs // 16, "num_stages": st, "blocks": blocks}
            try:
                diff = float((scores(0, cfg) - ref).abs().max())
                us = graph_us(lambda i, cfg=cfg: scores(i, cfg), calls)
            except Exception as e:  # a tile that does not fit is a data point, not the end of the sweep
                res["scores"].append({**cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            res["scores"].append({**cfg, "us": round(us, 2), "max_abs_diff": diff,
                                  "max_rel_diff": diff / float(ref[torch.isfinite(ref)].abs().max())})
        sel = torch.empty(t, 2048, dtype=torch.int64, device="cuda")

        def select(i, chunk, coop, ref=ref, tables=tables, req=req, pos=pos, sel=sel):
            select_rows = triton_indexer_coop.coop_select if coop else triton_indexer_long.long_row_select
            select_rows(ref, tables[0], req, pos, sel, 2048, ps, chunk=chunk)
            return sel

        want = select(0, triton_indexer_long.CHUNK, False).sort(dim=1).values.clone()
        for chunk, coop in itertools.product((1024, 2048, 4096, 8192), (False, True)):
            if coop and t * -(-ctx // chunk) > torch.cuda.get_device_properties(0).multi_processor_count:
                continue
            same = bool(torch.equal(select(0, chunk, coop).sort(dim=1).values, want))
            us = graph_us(lambda i, c=chunk, co=coop: select(i, c, co), calls)
            res["select"].append({"chunk": chunk, "coop": coop, "us": round(us, 2), "same_slots": same})
        # scores + cooperative select (two launches, the chunk they take) against the one fused launch at each chunk,
        # both over each call's own pages
        def apart(i, q=q, w=w, tables=tables, req=req, pos=pos, sel=sel, chunk=long_select_chunk(t, ctx)):
            triton_indexer_coop.coop_select(scores(i, {}), tables[i], req, pos, sel, 2048, ps, chunk)
            return sel

        def fused(i, chunk, stages=None, q=q, w=w, tables=tables, req=req, pos=pos, sel=sel, cache=cache):
            triton_indexer_coop.coop_score_select(q[i], w[i], cache, tables[i], req, pos, sel, 2048, ps, chunk,
                                                  stages=stages)
            return sel

        want0 = apart(0).clone()
        res["apart_us"] = round(graph_us(apart, calls), 2)
        res["fused"] = []
        for chunk, stages in itertools.product((256, 512, 1024, 2048, 4096), (3, 6)):
            if not triton_indexer_coop.coop_fits(t, -(-ctx // chunk), q):
                continue
            same = bool(torch.equal(fused(0, chunk, stages), want0))
            us = graph_us(lambda i, c=chunk, st=stages: fused(i, c, st), calls)
            res["fused"].append({"chunk": chunk, "stages": stages, "us": round(us, 2), "same_slots": same,
                                 "default": chunk == fused_select_chunk(t, ctx) and stages == 3})
        print(f"T={t} keys {ctx}: scores + select {res['apart_us']} us; fused "
              + ", ".join(f"chunk {c['chunk']}/st{c['stages']}{'*' if c['default'] else ''} {c['us']} us"
                          f"{'' if c['same_slots'] else ' DIFFERENT'}" for c in res["fused"]), flush=True)
        best = min((c for c in res["scores"] if "us" in c), key=lambda c: c["us"])
        print(f"T={t} keys {ctx}: scores default {res['scores_default_us']} us, best {best}; select "
              + ", ".join(f"chunk {c['chunk']}{' coop' if c['coop'] else ''} {c['us']} us"
                          f"{'' if c['same_slots'] else ' DIFFERENT'}" for c in res["select"]), flush=True)
        rows.append(res)
        del cache
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "sweep_decode_b1_indexer.json").write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--tokens", default="1,2")
    ap.add_argument("--valid", default="1024,2048")
    ap.add_argument("--splits", default="0,16,32,64", help="0: pick_splits' choice")
    ap.add_argument("--indexer", action="store_true", help="sweep the indexer's scores and select instead")
    args = ap.parse_args()
    if args.indexer:
        return sweep_indexer(Path(args.out))
    torch.manual_seed(0)
    pool_rows = 1 << 21
    cache = torch.cat([encode_latent(torch.randn(1 << 18, DC + DR, device="cuda"), FP8, DC) for _ in range(8)])
    rows = []
    for t, valid in itertools.product(map(int, args.tokens.split(",")), map(int, args.valid.split(","))):
        slots = torch.full((args.calls, t, TOPK), -1, dtype=torch.int64, device="cuda")
        slots[:, :, :valid] = torch.randint(0, pool_rows, (args.calls, t, valid), device="cuda")
        qn = torch.randn(args.calls, t, H, DC, device="cuda", dtype=torch.bfloat16)
        qr = torch.randn(args.calls, t, H, DR, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(qn)

        def run(i: int, cfg: dict | None, qn=qn, qr=qr, slots=slots, out=out) -> torch.Tensor:
            if cfg and cfg.get("kernel") == "swap":
                conf = {k: v for k, v in cfg.items() if k != "kernel"}
                return swap.sparse_mla_attention_swap(qn[i], qr[i], cache, FP8, slots[i], 0.04, DC, out=out[i],
                                                      config=conf)
            return tsm.sparse_mla_attention(qn[i], qr[i], cache, FP8, slots[i], 0.04, DC, out=out[i], config=cfg)

        ref = run(0, None).clone()
        base = graph_us(lambda i: run(i, None), args.calls)
        res = {"tokens": t, "valid": valid, "default_us": round(base, 2), "configs": []}
        for cfg, sp in itertools.product(tile_configs(), map(int, args.splits.split(","))):
            cfg = {**cfg, "splits": sp or None}
            try:
                diff = float((run(0, cfg).float() - ref.float()).abs().max() / ref.float().abs().max())
                us = graph_us(lambda i, cfg=cfg: run(i, cfg), args.calls)
            except Exception as e:  # a tile past the SM's shared memory: recorded, not fatal
                res["configs"].append({**cfg, "error": f"{type(e).__name__}: {str(e)[:120]}"})
                continue
            res["configs"].append({**cfg, "us": round(us, 2), "max_rel_diff": diff})
        ok = [c for c in res["configs"] if "us" in c and c["max_rel_diff"] < 2e-2]
        res["best"] = best = min(ok, key=lambda c: c["us"]) if ok else {"us": float("nan")}
        rows.append(res)
        print(f"T={t} valid {valid}: default {base:.2f} us, best {best['us']:.2f} us ({base / best['us']:.2f}x) "
              f"{json.dumps({k: v for k, v in best.items() if k not in ('us', 'max_rel_diff')})}", flush=True)
        for c in sorted(ok, key=lambda c: c["us"])[:6]:
            print(f"   {c['us']:7.2f} us  {json.dumps({k: v for k, v in c.items() if k != 'us'})}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sweep_decode_b1.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
