"""A warm start computes what a cold start computes (issue 16): the same dummy-weight model's logits from a start
with empty caches and from a start that reuses them (warm-start record: preloaded kernels, a cached memory
profile, no eager prefill warmup, graphs captured without their own eager runs), over the paths a step can take:
a 1-token prefill (decode graph), prefills that replay piecewise graphs or run eagerly, and a 3-row decode.

Run on the device (~50 s):
    PYTHONPATH=. DSASERVE_CACHE_DIR=/tmp/c python bench/warm_vs_cold_logits.py --save /tmp/cold.pt
    PYTHONPATH=. DSASERVE_CACHE_DIR=/tmp/c python bench/warm_vs_cold_logits.py --save /tmp/warm.pt \
        --against /tmp/cold.pt
The second prints, per step, whether its logits are finite and their largest difference from the first's (the
H200, 2026-12-01: 0.0 for all six). A start that hangs dumps every thread's stack after --timeout seconds.
"""

from __future__ import annotations

import argparse
import faulthandler
import time

import torch

STEPS = ([0], list(range(1, 9)), list(range(1, 100)), list(range(1, 700)), [5] * 40)  # 1-token prefill .. eager


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="glm-5.3-slice")
    ap.add_argument("--save", required=True, help="where this start's logits go (torch.save)")
    ap.add_argument("--against", default=None, help="an earlier start's --save to compare with")
    ap.add_argument("--timeout", type=int, default=120)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    from dsaserve.engine.model_runner import ModelRunner
    from dsaserve.model.forward_batch import contiguous_batch

    t0 = time.time()
    r = ModelRunner.from_kwargs(args.model, load_format="dummy", device="cuda", dtype="bfloat16")
    print(f"built in {time.time() - t0:.2f} s, warm-start preload: {r.warm_start.preload_report.get('status')}",
          flush=True)
    outs = [r.forward(contiguous_batch([toks], [0], [i * 16 * r.page_size], r.page_size)).float().cpu()
            for i, toks in enumerate(STEPS)]
    outs.append(r.forward(contiguous_batch([[7], [8], [9]], [1, 8, 99], [0, 16 * r.page_size, 32 * r.page_size],
                                           r.page_size)).float().cpu())
    torch.save(outs, args.save)
    ref = torch.load(args.against) if args.against else [None] * len(outs)
    for name, out, want in zip([f"prefill {len(s)}" for s in STEPS] + ["decode 3 rows"], outs, ref, strict=True):
        line = f"{name:>14}: finite {bool(torch.isfinite(out).all())}"
        if want is not None:
            same = torch.equal(out.argmax(-1), want.argmax(-1))
            line += f", max |diff| {float((out - want).abs().max()):.3g}, argmax equal {same}"
        print(line, flush=True)
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
