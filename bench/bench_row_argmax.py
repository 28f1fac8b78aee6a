"""The greedy sampler's argmax on the GPU: torch's `argmax(-1)` against `kernels/triton_argmax.row_argmax`, each
beside its bytes' bound at the copy rate measured in the same run (an argmax reads the logits once).

Each op is timed as a CUDA graph of REPLAYS back-to-back calls (GPU time a call, the launch gaps included, as the
sampler's launches queue behind the forward under overlap scheduling), and eagerly with events around one call
(`bench_gpu.cuda_time`: the host's launch inside, as the thirty-second session measured 20.8 / 32.1 / 45.5 µs).
Every case also checks the kernel's tokens equal torch's.

    PYTHONPATH=. python bench/bench_row_argmax.py [--rows 1,8,64,128,256] [--vocab 154880]
"""

from __future__ import annotations

import argparse

import torch

from bench.bench_gpu import cuda_time

REPLAYS = 20


def graph_time(fn, replays: int = REPLAYS) -> float:
    """Seconds a call of fn, from a CUDA graph of `replays` calls (median of 10 replays of the graph)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the stream warmed above: its argmax workspace exists
        for _ in range(replays):
            fn()
    return cuda_time(graph.replay, iters=10) / replays


def copy_rate() -> float:
    """Bytes a second of a 2 GiB device copy (read + write), far past the L2."""
    n = 1 << 31
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 255), torch.empty(n, dtype=torch.uint8,
                                                                                             device="cuda")
    return 2 * n / cuda_time(lambda: dst.copy_(src))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,64,128,256")
    ap.add_argument("--vocab", type=int, default=154_880)  # GLM-5.3's
    args = ap.parse_args()
    from dsaserve.kernels import triton_argmax

    rate = copy_rate()
    print(f"copy rate {rate / 1e12:.2f} TB/s; vocabulary {args.vocab}; graph of {REPLAYS} calls")
    triton_argmax.workspace(torch.device("cuda"))  # before any capture
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.vocab, device="cuda").to(dtype)
            assert torch.equal(triton_argmax.row_argmax(x), x.argmax(-1)), (dtype, rows)
            bound = x.numel() * x.element_size() / rate
            ops = (lambda x=x: x.argmax(-1), lambda x=x: triton_argmax.row_argmax(x))
            t_torch, t_kernel = (graph_time(op) for op in ops)
            e_torch, e_kernel = (cuda_time(op, iters=50) for op in ops)
            splits = triton_argmax.split_plan(rows, args.vocab, sms)
            print(f"{str(dtype)[6:]:8s} rows {rows:4d}: torch {t_torch * 1e6:7.1f} us ({t_torch / bound:5.2f}x bound), "
                  f"kernel {t_kernel * 1e6:7.1f} us ({t_kernel / bound:5.2f}x; {splits[0]} programs a row), "
                  f"bound {bound * 1e6:6.1f} us; eager torch {e_torch * 1e6:.1f} / kernel {e_kernel * 1e6:.1f} us; "
                  f"kernel / torch {t_kernel / t_torch:.2f}")


if __name__ == "__main__":
    main()
