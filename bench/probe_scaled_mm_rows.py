"""cuBLAS's block-scaled FP8 GEMM (`_scaled_mm`) at decode batch sizes, by how many rows it is called with (issue 17:
at batch 128 the slice's projections run at 0.9-2.4 TB/s; o_proj, qkv_a and the dense down fill 22-48 of the 132
SMs with 128 x 128 output tiles).

Run on the device:  PYTHONPATH=. python bench/probe_scaled_mm_rows.py --out $OUT
Each case is a CUDA graph over copies of the shape's weight (over 200 MB in all: from HBM, not L2). Variants:
the activations quantised and padded to `pad` rows, then `_scaled_mm` (the product's first M rows kept), with and
without the quantiser; every variant's output against the shipped one (pad 16). `--swap`: the same product with the
operands swapped (`_scaled_mm(W, x^T)`: the weight as torch's first operand with its 128 x 128 scales, the tokens
the second with 1 x 128, out^T = W x^T; torch hands cuBLAS a row-major product as its transpose, so cuBLAS sees
(m = tokens, n = N) where the shipped call is (m = N, n = tokens)), read back as a transposed view and as a
contiguous copy. Measured on an H100 (bench/RESULTS.md, thirty-ninth session): the swapped view is bit-identical
to the shipped product and takes the same time at every shape (apparently the same kernel; its name was not
recorded), so swapping only adds the copy; not used by the engine.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from bench.bench_kernels import graph_time, measure_ceilings
from dsaserve.kernels.cublaslt_tuning import fp8_weight_copies
from dsaserve.kernels.triton_fp8_gemm import quant_act_fp8

# (name, N, K) of the glm-5.3-slice's decode projections (qkv_a: q_a 2048 + kv_a 576 padded to 640 + wk 128)
SHAPES = [("qkv_a", 2816, 6144), ("q_b", 16384, 2048), ("o_proj", 6144, 16384), ("dense gate_up", 24576, 6144),
          ("dense down", 6144, 12288), ("shared gate_up", 4096, 6144), ("shared down", 6144, 2048)]


def weight_copies(n: int, k: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    """Copies of an [N, K] e4m3 weight and its 128 x 128 scales, over 200 MB in all (each replay reads HBM, not
    L2), and one copy's bytes."""
    return fp8_weight_copies(n, k, "cuda", 200_000_000), n * k + 4 * (n // 128) * (k // 128)


def _mm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, s: torch.Tensor, m: int) -> torch.Tensor:
    return torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=s.t(), out_dtype=torch.bfloat16)[:m]


def _swap_mm(a: torch.Tensor, a_s: torch.Tensor, w: torch.Tensor, s: torch.Tensor, m: int,
             contiguous: bool) -> torch.Tensor:
    """out^T = W a^T: `a_s` is the outer-dim-major (M, K/128) activation scale, so `a_s.t()` is torch's 1 x 128
    scale_b for a^T."""
    y = torch._scaled_mm(w, a.t(), scale_a=s, scale_b=a_s.t(), out_dtype=torch.bfloat16)[:, :m].t()
    return y.contiguous() if contiguous else y


def swap_cases(out: list[dict], rows: list[int]) -> None:
    """Each projection shape at `rows` tokens: cuBLAS as shipped against the swapped operands (the same quantised
    inputs)."""
    for name, n, k in SHAPES:
        ws, nbytes = weight_copies(n, k)
        for m in rows:
            a, a_s = quant_act_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), pad_m_to=16,
                                   scale_m_major=True)
            want = _mm(a, a_s, *ws[0], m).float()
            try:
                got = _swap_mm(a, a_s, *ws[0], m, True).float()
            except (RuntimeError, ValueError) as e:  # this torch / cuBLAS may refuse the (128 x 128, 1 x 128) pair
                print(f"{name} m {m}: swapped operands refused: {e}", flush=True)
                continue
            rel = float(((got - want).norm() / want.norm()).item())
            times = {v: graph_time([functools.partial(f, a, a_s, w, s, m, *extra) for w, s in ws])
                     for v, f, extra in (("shipped", _mm, ()), ("swap_view", _swap_mm, (False,)),
                                         ("swap_copy", _swap_mm, (True,)))}
            out.append({"shape": name, "n": n, "k": k, "m": m, "rel": rel,
                        **{f"{v}_us": t * 1e6 for v, t in times.items()}})
            print(f"{name:15s} m {m:4d}: " + ", ".join(f"{v} {t * 1e6:7.2f} us ({nbytes / t / 1e12:.2f} TB/s)"
                                                       for v, t in times.items()) + f", rel {rel:.1e}", flush=True)
        del ws


def _quant_mm(x: torch.Tensor, pad: int, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return _mm(*quant_act_fp8(x, pad_m_to=pad, scale_m_major=True), w, s, x.shape[0])


QUANT_TILES = [(1, 4), (1, 8), (1, 16), (1, 32), (2, 8), (2, 16), (4, 4), (4, 8)]


def quant_tiles(out: list[dict]) -> None:
    """The activation quantiser (`quant_act_fp8`, cuBLAS's scale layout) by program tile (rows, 128-groups) at the
    decode projections' K and 128 rows (and the MoE's 1024 pairs), each against the shipped tile's bytes."""
    from dsaserve.kernels import triton_fp8_gemm as G

    for m, k in ((128, 2048), (128, 6144), (128, 12288), (128, 16384), (1024, 2048), (64, 16384)):
        xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        want = quant_act_fp8(xs[0], pad_m_to=16, scale_m_major=True)
        for rows, groups in QUANT_TILES:
            G.QUANT_TILE.update(rows=rows, groups=groups)
            try:
                got = quant_act_fp8(xs[0], pad_m_to=16, scale_m_major=True)
                same = all(torch.equal(g.float(), w.float()) for g, w in zip(got, want, strict=True))
                t = graph_time([functools.partial(quant_act_fp8, x, 16, True) for x in xs])
            finally:
                G.QUANT_TILE.clear()
            out.append({"quant_m": m, "k": k, "rows": rows, "groups": groups, "us": t * 1e6, "same": same})
            print(f"quant m {m:5d} k {k:6d} rows {rows} groups {groups:2d}: {t * 1e6:6.2f} us, "
                  f"{3 * m * k / t / 1e12:.2f} TB/s, same {same}", flush=True)


def _quant_splitk(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, split: int) -> torch.Tensor:
    from dsaserve.kernels import gluon_fp8_splitk as SK

    return SK.fp8_splitk_gemm(*quant_act_fp8(x, scale_m_major=True), w, s, split)


def splitk(out: list[dict], rows: list[int], shapes: set[str] | None = None,
           depths: tuple[int, ...] | None = None) -> None:
    """`gluon_fp8_splitk.fp8_splitk_gemm` against `_scaled_mm` on the same quantised activations: at 1 split, at
    `choose_split`'s and around it (below 64 rows a wider sweep of splits), at each ring depth of `depths` (default
    the kernel's STAGES); each output checked against `_scaled_mm`'s first. Also fp8_linear from bf16 rows without
    this kernel against the quantiser + it."""
    from dsaserve.kernels import gluon_fp8_splitk as SK
    from dsaserve.kernels import triton_fp8_gemm as G

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, n, k in (shape for shape in SHAPES if shapes is None or shape[0] in shapes):
        ws, nbytes = weight_copies(n, k)
        best = SK.choose_split(n, k, sms)
        for m in rows:  # memory-bound below 64 rows: a wider sweep of splits at one depth
            splits = sorted(s for s in ({1, best, max(1, best - 1), best + 1} if m >= 64 else {1, 2, 3, 4, 6, 8, 12})
                            if SK.split_fits(k // 128, s))
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            a, a_s = quant_act_fp8(x, scale_m_major=True)
            pad = quant_act_fp8(x, pad_m_to=16, scale_m_major=True)  # cuBLAS takes M in multiples of 16
            want = _mm(*pad, *ws[0], m).float()
            t_ref = graph_time([functools.partial(_mm, *pad, w, s, m) for w, s in ws])
            # the path from bf16 rows without this kernel (skinny kernel to 32 rows, else quantiser + cuBLAS)
            # against the quantiser + this kernel at its chosen split
            shipped, G.SPLITK_GEMM = G.SPLITK_GEMM, False  # the path before this kernel
            try:
                t_ship = graph_time([functools.partial(G.fp8_linear, x, w, s) for w, s in ws])
            finally:
                G.SPLITK_GEMM = shipped
            t_both = graph_time([functools.partial(_quant_splitk, x, w, s, best) for w, s in ws])
            print(f"splitk {name:15s} m {m:4d}: fp8_linear without it {t_ship * 1e6:7.2f} us, quantiser + split "
                  f"{best} {t_both * 1e6:7.2f} us ({t_ship / t_both:.2f}x)", flush=True)
            out.append({"shape": name, "m": m, "shipped_us": t_ship * 1e6, "quant_splitk_us": t_both * 1e6})
            for split in splits:
                for stages in depths or (SK.STAGES,):
                    run = functools.partial(SK.fp8_splitk_gemm, a, a_s, split=split, stages=stages)
                    try:
                        rel = float(((run(*ws[0]).float() - want).norm() / want.norm()).item())
                    except Exception as e:  # noqa: BLE001 - a config past shared memory must not stop the rest
                        print(f"splitk {name} m {m} split {split} st {stages}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    t = graph_time([functools.partial(run, w, s) for w, s in ws]) if rel < 1e-2 else float("nan")
                    out.append({"shape": name, "m": m, "split": split, "stages": stages,
                                "chosen": split == best, "us": t * 1e6, "scaled_mm_us": t_ref * 1e6, "rel": rel})
                    print(f"splitk {name:15s} m {m:4d} split {split:2d}{'*' if split == best else ' '} st {stages}: "
                          f"{t * 1e6:7.2f} us ({nbytes / t / 1e12:.2f} TB/s) against _scaled_mm {t_ref * 1e6:7.2f} "
                          f"({t_ref / t:.2f}x), rel {rel:.1e}", flush=True)
        del ws


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", action="store_true", help="only the activation quantiser's tiles")
    ap.add_argument("--swap", action="store_true", help="only the swapped-operand cases (_scaled_mm(W, x^T))")
    ap.add_argument("--splitk", action="store_true", help="only the Gluon split-K GEMM against _scaled_mm")
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--pads", default="16,256,384,512")
    ap.add_argument("--shapes", default="", help="--splitk's projections by name, comma-separated (default: all)")
    ap.add_argument("--stages", default="", help="--splitk's ring depths, e.g. 4,5,6 (default: the kernel's)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ceilings = measure_ceilings()
    print({k: round(v / 1e12, 3) for k, v in ceilings.items()}, "(TB/s, TFLOP/s)", flush=True)
    rows = []
    if args.quant:
        quant_tiles(rows)
    if args.swap:
        swap_cases(rows, [int(v) for v in args.rows.split(",")])
    if args.splitk:
        splitk(rows, [int(v) for v in args.rows.split(",")], set(args.shapes.split(",")) if args.shapes else None,
               tuple(int(v) for v in args.stages.split(",")) if args.stages else None)
    for name, n, k in SHAPES if not (args.quant or args.swap or args.splitk) else ():
        ws, nbytes = weight_copies(n, k)
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = None
            for pad in (int(v) for v in args.pads.split(",")):
                a, a_s = quant_act_fp8(x, pad_m_to=pad, scale_m_major=True)
                y = _mm(a, a_s, *ws[0], m)
                want = y if want is None else want
                rel = float(((y.float() - want.float()).norm() / want.float().norm()).item())
                t_mm = graph_time([functools.partial(_mm, a, a_s, w, s, m) for w, s in ws])
                t_all = graph_time([functools.partial(_quant_mm, x, pad, w, s) for w, s in ws])
                row = {"shape": name, "n": n, "k": k, "m": m, "pad": pad, "mm_us": t_mm * 1e6,
                       "quant_mm_us": t_all * 1e6, "mm_tb_s": nbytes / t_mm / 1e12, "rel": rel}
                rows.append(row)
                print(f"{name:15s} m {m:4d} pad {pad:4d}: mm {t_mm * 1e6:7.2f} us ({nbytes / t_mm / 1e12:.2f} TB/s), "
                      f"quant+mm {t_all * 1e6:7.2f} us, rel {rel:.1e}", flush=True)
        del ws
    (args.out / "probe_scaled_mm_rows.json").write_text(json.dumps({"ceilings": ceilings, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
