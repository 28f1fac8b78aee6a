"""H200 benchmark (issue: the GPU fast path): decode step time vs its HBM roofline, prefill vs the FLOP
roofline, HF transformers on the same config in the same run, first request after Up vs steady state, and
startup seconds per phase.

Run on the device:  PYTHONPATH=. python bench/bench_gpu.py --out $OUT
Every ratio printed is measured/bound from this one run: the copy bandwidth and GEMM rates are measured
here first and used as the ceilings. Bytes a decode step must read = weights it touches (attention + dense
MLPs + router + shared expert + lm_head + the routed experts the step touched, as counted on the device by
`moe_experts_touched`) + the KV rows sparse MLA gathers (min(topk, ctx) x 656 B x layers) + the indexer keys scored
(ctx x 132 B x full layers), per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dsaserve.common.causal import takes_every_key
from dsaserve.common.index_pages import write_rows
from dsaserve.common.kv_layout import encode_index_k, encode_latent
from dsaserve.engine.memory_profile import dummy_decode, dummy_prefill
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.kernels.registry import get_ops
from dsaserve.ledger.reconcile import graph_width
from dsaserve.model.layers.linear import Linear
from dsaserve.model.layers.moe import Experts, fold_device_expert_counts


def cuda_time(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of fn() over `iters` runs, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def pipelined_time(fn, steps: int = 50) -> float:
    """Seconds per step of `steps` calls issued back to back (one sync at the end): the host prepares step
    N+1 while the GPU runs step N, as an overlapping scheduler would. Beside cuda_time's synchronous
    steps it shows how much of a step is host time the GPU waits through."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(steps):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / steps


def measure_ceilings() -> dict:
    n = 1 << 31  # 2 GiB: far past the 60 MB L2
    bufs = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(2)]
    bufs[0].random_(0, 255)
    copy = cuda_time(lambda: bufs[1].copy_(bufs[0]))
    bufs.clear()
    m = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    gemm = cuda_time(lambda: m @ k, iters=10)
    one = torch.ones((), device="cuda")
    m8, k8 = m.to(torch.float8_e4m3fn), k.to(torch.float8_e4m3fn).t()
    fp8 = cuda_time(lambda: torch._scaled_mm(m8, k8, one, one, out_dtype=torch.bfloat16), iters=10)
    return {"copy_bytes_per_s": 2 * n / copy, "bf16_flops": 2 * 8192**3 / gemm, "fp8_flops": 2 * 8192**3 / fp8}


def fill_pool(pool, cfg) -> None:
    """Random (finite) KV and indexer keys everywhere: never time attention over zeros."""
    chunk = 1 << 16
    for layer in pool.kv_layer_ids:
        for s in range(0, pool.num_slots, chunk):
            slots = torch.arange(s, min(s + chunk, pool.num_slots), device=pool.kv_buffer.device)
            pool.kv_cache(layer)[slots] = encode_latent(torch.randn(len(slots), cfg.kv_latent_dim, device=slots.device),
                                                        pool.layout, cfg.kv_lora_rank)
            if layer in pool.index_row:
                keys = torch.randn(len(slots), cfg.index_head_dim, device=slots.device)
                write_rows(pool.index_cache(layer), slots, encode_index_k(keys, pool.layout), pool.layout,
                           cfg.index_head_dim)


def touched_weight_bytes(model, bs: int, expert_bytes: float | None = None) -> float:
    """Bytes of weights a decode step of `bs` tokens reads. Routed experts: `expert_bytes` (what the step
    measurably touched, `moe_experts_touched`), else the uniform-routing expectation E(1-(1-k/E)^bs)."""
    cfg, total = model.cfg, 0.0
    for layer in model.model.layers[: cfg.num_hidden_layers]:
        for m in layer.modules():
            if isinstance(m, Linear) and m is not layer.self_attn.kv_b_proj:  # kv_b is absorbed, read as W_uk/W_uv
                total += m.disk_bytes
            elif isinstance(m, Experts) and expert_bytes is None:
                e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                total += e * (1 - (1 - k / e) ** bs) * m.expert_bytes
        attn = layer.self_attn
        total += (attn.w_uk.numel() + attn.w_uv_t.numel()) * attn.w_uk.element_size()
        if hasattr(layer.mlp, "gate"):
            total += layer.mlp.gate.weight.numel() * 2
    return total + (expert_bytes or 0.0) + model.lm_head.weight.numel() * model.lm_head.weight.element_size()


def skips_queries(runner, bs: int, ctx: int) -> bool:
    """Whether a decode step of bs rows at `ctx` runs without indexer queries (the engine's `StepContext.all_keys`):
    a whole forward (not piecewise segments) at a page table within the top-k (`ledger/reconcile.graph_width`: the
    narrowest decode-graph class that holds its rows, none narrow under DP-attention's gather graphs or
    --disable-narrow-decode-graphs; eagerly the rows' own)."""
    graphs, piecewise = getattr(runner, "graphs", None), getattr(runner, "piecewise", None)
    width, segments = graph_width(-(-(ctx + 1) // runner.page_size), True, bs, bs, graphs.widths if graphs else (),
                                  graphs.max_bs if graphs else 0, piecewise.max_tokens if piecewise else 0)
    return not segments and takes_every_key(width, runner.page_size, runner.cfg.index_topk)


def decode_bytes(runner, bs: int, ctx: int, expert_bytes: float | None = None) -> dict:
    """What a decode step must read. Rows within the top-k take every key: no indexer key is scored (whatever the
    width), and where the step's page table is within the top-k too (`skips_queries`) no query is made (wq_b,
    weights_proj); neither is counted then (until the twenty-eighth session the bound counted both at every
    context). The engine's byte counters (`model/step_counts.py`) and the ledger follow the page-table width for
    both; rows within the top-k in a wider table score no key on the GPU, which they do not model."""
    cfg, pool = runner.cfg, runner.kv_pool
    n_full = len(cfg.full_indexer_layers)
    w = touched_weight_bytes(runner.model, bs, expert_bytes)
    kv = bs * min(cfg.index_topk, ctx + 1) * pool.kv_bpt * cfg.num_hidden_layers
    idx = 0 if ctx + 1 <= cfg.index_topk else bs * (ctx + 1) * pool.idx_bpt * n_full
    if skips_queries(runner, bs, ctx):
        w -= runner.model.forward_shape().query_weight_bytes
    return {"weights": w, "kv": kv, "indexer": idx, "total": w + kv + idx}


def bench_decode(runner, ceilings, batches, contexts, tokens: str = "distinct") -> list[dict]:
    """tokens: "distinct" (each row its own token, as a serving batch's requests), "same" (token 1 in every row:
    the runs before 2026-12-04), "both" (batches over 1 row both ways, each row marked `same_token`)."""
    rows = []
    for ctx in contexts:
        for bs in batches:
            if bs * -(-(ctx + 1) // runner.page_size) > runner.num_pages:
                rows.append({"bs": bs, "ctx": ctx, "skipped": "pool too small"})
                continue
            modes = (False, True) if tokens == "both" and bs > 1 else (tokens == "same",)
            rows += [_decode_row(runner, ceilings, bs, ctx, same) for same in modes]
    return rows


def _decode_row(runner, ceilings, bs: int, ctx: int, same: bool) -> dict:
    """One decode case: its synchronous and overlapped step against the bytes it touched."""
    vocab = 0 if same else runner.cfg.vocab_size
    batch = dummy_decode(bs, ctx, runner.page_size, "cpu", vocab)  # a host batch, as the engine hands over
    fold_device_expert_counts(reset=True)
    t = cuda_time(lambda: runner.forward(batch), iters=20, warmup=3)
    touched = fold_device_expert_counts(reset=True)  # over the 23 steps just run
    need = decode_bytes(runner, bs, ctx, touched["weight_bytes_read"] / 23)
    bound = need["total"] / ceilings["copy_bytes_per_s"]
    piped = pipelined_time(lambda: runner.forward(batch))  # the overlap scheduler's steady state
    # what a plain greedy batch's sampler adds on the device: the argmax of the step's logits (model/sampler.py's,
    # the registry's row_argmax)
    argmax = get_ops(runner.device).row_argmax
    greedy = pipelined_time(lambda: argmax(runner.forward(batch)))
    return {"bs": bs, "ctx": ctx, "same_token": same, "step_ms": t * 1e3, "roofline_ms": bound * 1e3,
            "ratio": t / bound, "overlapped_ms": piped * 1e3, "overlapped_ratio": piped / bound,
            "overlapped_greedy_ms": greedy * 1e3,
            "tokens_per_s": bs / t, "bytes": need, "experts_touched": touched["moe_experts_touched"] / 23,
            "uniform_routing_bytes": decode_bytes(runner, bs, ctx)["total"]}


def prefill_flops(cfg, n: int) -> float:
    """FLOPs of one n-token prefill: GEMMs (2 x params touched per token) + indexer scores + sparse MLA."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    attn = h * cfg.q_lora_rank + cfg.q_lora_rank * heads * cfg.qk_head_dim + h * cfg.kv_latent_dim
    attn += heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank + heads * cfg.v_head_dim * h
    idx = cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + h * cfg.index_head_dim + h * cfg.index_n_heads
    moe = 3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    dense = 3 * h * cfg.intermediate_size
    params = sum(attn + (idx if cfg.is_full_indexer(i) else 0) + (moe if cfg.is_moe(i) else dense)
                 for i in range(cfg.num_hidden_layers))
    gemm = 2 * params * n + 2 * h * cfg.vocab_size  # lm_head on the last token only
    keys = n * (n + 1) / 2
    indexer = 2 * keys * cfg.index_n_heads * cfg.index_head_dim * len(cfg.full_indexer_layers)
    selected = sum(min(cfg.index_topk, p + 1) for p in range(n))
    mla = 2 * selected * heads * (cfg.kv_latent_dim + cfg.kv_lora_rank) * cfg.num_hidden_layers
    return gemm, indexer + mla


def bench_prefill(runner, ceilings, lengths) -> list[dict]:
    rows = []
    for n in lengths:
        if -(-n // runner.page_size) > runner.num_pages:
            continue
        batch = dummy_prefill(n, runner.page_size, runner.cfg.vocab_size, runner.device)
        t = cuda_time(lambda b=batch: runner.forward(b), iters=3, warmup=1)
        gemm, attn = prefill_flops(runner.cfg, n)
        bound = gemm / ceilings["fp8_flops"] + attn / ceilings["bf16_flops"]
        rows.append({"tokens": n, "seconds": t, "tokens_per_s": n / t, "roofline_s": bound, "ratio": t / bound,
                     "gemm_tflop": gemm / 1e12, "attention_tflop": attn / 1e12})
    return rows


def first_vs_steady(runner, n: int) -> dict:
    """TTFT of the first prefill of a warmed shape right after startup, against the same shape repeated."""
    batch = dummy_prefill(n, runner.page_size, runner.cfg.vocab_size, runner.device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.forward(batch)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    steady = []
    for _ in range(5):
        t0 = time.perf_counter()
        runner.forward(batch)
        torch.cuda.synchronize()
        steady.append(time.perf_counter() - t0)
    s = statistics.median(steady)
    return {"tokens": n, "first_s": first, "steady_s": s, "ratio": first / s}


def bench_hf(config_name: str, cases: list[tuple[int, int]]) -> list[dict]:
    """HF transformers GlmMoeDsaForCausalLM, bf16, random init, same config: decode ms/step."""
    import transformers

    from dsaserve.config import load_config

    raw = json.loads(load_config(config_name).to_json())
    raw.pop("quantization_config", None)
    cfg = transformers.GlmMoeDsaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    with torch.device("cuda"):
        model = transformers.GlmMoeDsaForCausalLM(cfg).to(torch.bfloat16).eval()
    rows = []
    for bs, ctx in cases:
        ids = torch.randint(0, cfg.vocab_size, (bs, ctx), device="cuda")
        with torch.no_grad():
            cache = transformers.DynamicCache(config=cfg)
            model(ids, past_key_values=cache, use_cache=True)
            nxt = torch.randint(0, cfg.vocab_size, (bs, 1), device="cuda")
            times = []
            for _ in range(6):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                model(nxt, past_key_values=cache, use_cache=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        rows.append({"bs": bs, "ctx": ctx, "step_ms": statistics.median(times[1:]) * 1e3})
        del cache
        torch.cuda.empty_cache()
    del model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="glm-5.3-slice")
    ap.add_argument("--out", default="bench-out")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--prefill", default="8192,32768")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--tokens", choices=("distinct", "same", "both"), default="distinct",
                    help="decode rows' tokens: each its own (a serving batch), token 1 in all (the runs before "
                    "2026-12-04: identical rows route alike, so a batch touches few experts), or both")
    ap.add_argument("--hf-cases", default="1x1024,1x4096,32x1024", help="HF decode cases, BSxCTX")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result["ceilings"] = ceilings = measure_ceilings()
    print("ceilings", {k: f"{v:.3e}" for k, v in ceilings.items()}, flush=True)
    t0 = time.perf_counter()
    runner = ModelRunner.from_kwargs(args.config, dtype="bfloat16", load_format="dummy", device="cuda",
                         cuda_graph_max_bs=max(batches), max_model_len=max(contexts) + 64,
                         chunked_prefill_size=max(int(x) for x in args.prefill.split(",")),
                         max_num_batched_tokens=max(int(x) for x in args.prefill.split(",")))
    result["startup_wall_s"] = time.perf_counter() - t0
    result["manifest"] = runner.manifest()
    print("startup", runner.startup_time, flush=True)
    dump = lambda: (out / "bench_gpu.json").write_text(json.dumps(result, indent=2, default=float))  # noqa: E731
    dump()
    result["first_vs_steady"] = first_vs_steady(runner, max(int(x) for x in args.prefill.split(",")))
    fill_pool(runner.kv_pool, runner.cfg)
    result["decode"] = bench_decode(runner, ceilings, batches, contexts, args.tokens)
    dump()
    print("decode", [(d["bs"], d["ctx"], round(d.get("step_ms", -1), 3), round(d.get("ratio", -1), 2),
                      round(d.get("overlapped_ms", -1), 3)) for d in result["decode"]], flush=True)
    result["prefill"] = bench_prefill(runner, ceilings, [int(x) for x in args.prefill.split(",")])
    from dsaserve.common.counters import COUNTERS

    result["counters"] = COUNTERS.snapshot()
    dump()
    del runner
    torch.cuda.empty_cache()
    if not args.skip_hf:
        cases = [tuple(int(v) for v in c.split("x")) for c in args.hf_cases.split(",")]
        result["hf"] = bench_hf(args.config, cases)
    dump()
    print_table(result)


def print_table(r: dict) -> None:
    print(f"\ncopy {r['ceilings']['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 {r['ceilings']['bf16_flops'] / 1e12:.0f} "
          f"TFLOP/s, fp8 {r['ceilings']['fp8_flops'] / 1e12:.0f} TFLOP/s")
    print("decode: bs ctx | ms/step | roofline ms | ratio | tok/s | overlapped ms/step | ratio | + greedy argmax")
    for d in r["decode"]:
        if "step_ms" in d:
            bs = f"{d['bs']:4d}{'s' if d.get('same_token') else ' '}"
            print(f"  {bs} {d['ctx']:6d} | {d['step_ms']:8.3f} | {d['roofline_ms']:8.3f} | {d['ratio']:5.2f} | "
                  f"{d['tokens_per_s']:9.1f} | {d['overlapped_ms']:8.3f} | {d['overlapped_ratio']:5.2f} | "
                  f"{d.get('overlapped_greedy_ms', float('nan')):8.3f}")
    for p in r["prefill"]:
        print(f"prefill {p['tokens']}: {p['seconds']:.3f}s {p['tokens_per_s']:.0f} tok/s, roofline "
              f"{p['roofline_s']:.3f}s ratio {p['ratio']:.2f}")
    print("first vs steady:", {k: round(v, 4) for k, v in r["first_vs_steady"].items()})
    for h in r.get("hf", []):
        ours = next((d for d in r["decode"] if d.get("bs") == h["bs"] and d.get("ctx") == h["ctx"]), None)
        speed = f" | ours {ours['step_ms']:.2f} ms -> {h['step_ms'] / ours['step_ms']:.1f}x" if ours else ""
        print(f"HF bs={h['bs']} ctx={h['ctx']}: {h['step_ms']:.2f} ms/step{speed}")
    print("startup:", r["manifest"]["startup_time"])


if __name__ == "__main__":
    main()
