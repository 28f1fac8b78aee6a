"""Piecewise segments under TP2 over gloo (engine/piecewise_runner.py): on each rank the segmented forward
(o_proj / MoE all-reduces inside the segments, the lm_head's all-gather after them) equals the plain
forward bit for bit, and the collectives one eager run of a bucket's segments measured — what a graph replay
adds to the counters — are the plain forward's, less the lm_head's all-gather."""

from __future__ import annotations

from pathlib import Path

import torch

from dsaserve.common.counters import COUNTERS
from dsaserve.engine.kv_pool import KVPool
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.engine.piecewise_runner import PiecewiseRunner
from dsaserve.model.forward_batch import contiguous_batch
from tests.distributed.harness import spawn

PAGES = 24


def _collectives(diff: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in diff.items() if k.startswith("collective_calls.")}


def _worker(rank: int, init_method: str, out_dir: str) -> None:
    r = ModelRunner.from_kwargs("glm-5.3-tiny", kv_layout="fp32", num_pages=PAGES, tensor_parallel_size=2,
                                dist_init_method=init_method)
    pools = [KVPool(r.cfg, PAGES, r.kv_pool.layout, r.model.kv_layer_ids, 64, r.dtype, r.device, sink_pages=1)
             for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, r.cfg.vocab_size, (n,), generator=g).tolist() for n in (90, 33)]
    steps = [contiguous_batch(prompts, [0, 0], [0, 5 * 64]),
             contiguous_batch([[3], prompts[1][:20]], [90, 33], [0, 5 * 64])]
    pw = PiecewiseRunner(r.model, pools[1], sorted({b.num_tokens for b in steps}), 4, PAGES)
    pw.capture()
    res = {"equal": [], "plain_calls": [], "segmented_calls": []}
    for b in steps:
        before = COUNTERS.snapshot()
        plain = r.model(b, pools[0])[0]
        mid = COUNTERS.snapshot()
        seg = pw.forward(b)
        res["plain_calls"].append(_collectives(COUNTERS.diff(mid, before)))
        res["segmented_calls"].append(_collectives(COUNTERS.diff(COUNTERS.snapshot(), mid)))
        res["equal"].append(torch.equal(plain, seg))
    res["static"] = {k: _collectives(v) for k, v in pw.static_counts.items()}
    res["tokens"] = [b.num_tokens for b in steps]  # = their buckets
    torch.save(res, Path(out_dir) / f"rank{rank}.pt")


def test_segmented_forward_equals_plain_on_each_tp_rank_and_counts_its_collectives(tmp_path):
    spawn(_worker, 2, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert res["equal"] == [True, True]
        assert res["segmented_calls"] == res["plain_calls"]  # eager segments count for themselves
        for plain, tokens in zip(res["plain_calls"], res["tokens"], strict=True):
            assert plain.pop("collective_calls.all_gather") == 1  # the lm_head's, after the segments
            assert plain["collective_calls.all_reduce"] > 0
            assert res["static"][tokens] == plain  # what a replay of the bucket adds
