"""The DP-attention MoE paths alone on 2 gloo ranks. The token exchange (`dp_exchange` / `idle_exchange`), with
routing chosen by hand: a rank with no tokens, a rank that receives nothing, uneven counts — every rank makes
the same 3 all_to_all calls and gets back exactly its own tokens' weighted expert outputs. The gather
(`dp_gather_forward`): uneven counts padded to the agreed rows, an idle rank, a graph's already padded batch —
one all_gather + one reduce_scatter each, every rank's own rows back, and padding rows never reach an expert."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsaserve.common.counters import COUNTERS
from dsaserve.distributed.expert_parallel import dp_exchange, dp_gather_forward, idle_exchange, local_routes
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


class GatherMoE:
    """The parts of an MoE layer `dp_gather_forward` uses: a row-wise gate (top-K experts from the row's own
    values, as a real router is), this rank's half of the ScaleExperts experts behind `local_routes` (absent
    experts' pairs skipped, as the kernels skip them), no shared expert. Records which rows reached an expert."""

    def __init__(self, rank: int, group):
        self.group, self.shared_experts, self.reached = group, None, []
        self.placement = SimpleNamespace(count=E // 2, first=rank * E // 2, total=E)

    def gate(self, x, ctx):
        ids = (x[:, :K].abs() * 1000).long() % E
        return torch.sigmoid(x[:, K:2 * K]), ids

    def experts(self, rows, weights, ids, ctx):
        w, local_ids, _ = local_routes(weights, ids, self.placement)
        here = local_ids < self.placement.count  # an absent expert's pair computes nothing
        self.reached.append(here.any(1))
        scale = (w * (local_ids + self.placement.first + 1) * here)[..., None]
        return (rows[:, None, :] * scale).sum(1)


def _every_expert(moe: GatherMoE, x: torch.Tensor) -> torch.Tensor:
    w, ids = moe.gate(x, None)
    return (x[:, None, :] * (w * (ids + 1))[..., None]).sum(1)


GATHERS = [((3, 1), 3, True), ((0, 2), 2, True), ((4, 4), 4, False)]  # (tokens, rows, eager: tokens known)


def _gather_main(rank: int, init_method: str) -> None:
    state = initialize_model_parallel(ep_size=2, dp_attention=True, init_method=init_method)
    for i, (tokens, rows, eager) in enumerate(GATHERS):
        moe = GatherMoE(rank, state.moe_group)
        x = torch.randn(tokens[rank], H, generator=torch.Generator().manual_seed(10 * i + rank))
        before = COUNTERS.snapshot()
        got = dp_gather_forward(moe, x, rows, tokens if eager else (), None)
        calls = COUNTERS.diff(COUNTERS.snapshot(), before)
        assert (calls["collective_calls.all_gather"], calls["collective_calls.reduce_scatter"]) == (1, 1), calls
        assert calls["collective_bytes.all_gather"] == 2 * rows * H * 4
        assert got.shape == x.shape and torch.allclose(got, _every_expert(moe, x), atol=1e-6), (rank, i)
        reached = moe.reached[0].view(2, rows)
        for r, n in enumerate(tokens):
            if eager:  # padding rows (beyond a rank's own tokens) route to no expert
                assert not reached[r, n:].any(), (rank, i, r)


def test_gather_pads_uneven_and_idle_ranks_and_returns_each_its_own_rows():
    spawn(_gather_main, 2)
