"""The DP-attention token exchange alone (`dp_exchange` / `idle_exchange`) on 2 gloo ranks, with routing
chosen by hand: a rank with no tokens, a rank that receives nothing, uneven counts — every rank makes the
same 3 all_to_all calls and gets back exactly its own tokens' weighted expert outputs."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsaserve.common.counters import COUNTERS
from dsaserve.distributed.expert_parallel import dp_exchange, idle_exchange
from dsaserve.distributed.parallel_state import initialize_model_parallel
from tests.distributed.harness import spawn

E, H, K = 8, 6, 2  # experts 0-3 on rank 0, 4-7 on rank 1


class ScaleExperts:
    """Expert e multiplies a row by (e + 1); it checks that only its rank's experts arrive."""

    def __init__(self, rank: int):
        self.placement = SimpleNamespace(count=E // 2, first=rank * E // 2)

    def __call__(self, rows, weights, ids, ctx):
        p = self.placement
        assert ((ids >= p.first) & (ids < p.first + p.count)).all()
        return rows * weights * (ids + 1).to(rows.dtype)


# per scenario, per rank: the experts of each of its tokens (None: idle, no tokens at all)
SCENARIOS = [
    ([[4, 5], [6, 7], [5, 4]], None),  # rank 0's pairs all go to rank 1; rank 1 idles; rank 0 receives nothing
    (None, [[0, 7], [1, 2], [3, 4], [0, 1], [6, 5]]),  # the other way round
    ([[0, 4]], [[1, 5], [2, 6], [3, 7]]),  # uneven, both ways
    ([], [[2, 3]]),  # a rank with a zero-token batch (not idle): same calls
]


def _rank_main(rank: int, init_method: str) -> None:
    state = initialize_model_parallel(ep_size=2, dp_attention=True, init_method=init_method)
    experts, g = ScaleExperts(rank), state.moe_group
    for i, routes in enumerate(s[rank] for s in SCENARIOS):
        before = COUNTERS.snapshot()
        if routes is None:
            idle_exchange(experts, g, H, torch.float32, torch.device("cpu"), None)
        else:
            gen = torch.Generator().manual_seed(10 * i + rank)
            x = torch.randn(len(routes), H, generator=gen)
            ids = torch.tensor(routes, dtype=torch.int64).view(len(routes), K)
            w = torch.rand(len(routes), K, generator=gen)
            got = dp_exchange(experts, g, x, w, ids, None)
            want = (x[:, None, :] * w[..., None] * (ids + 1)[..., None].float()).sum(1)
            assert torch.allclose(got, want, atol=1e-6), (rank, i)
        calls = COUNTERS.diff(COUNTERS.snapshot(), before)
        assert calls.get("collective_calls.all_to_all") == 3, (rank, i, calls)


def test_exchange_handles_idle_empty_and_uneven_ranks():
    spawn(_rank_main, 2)
