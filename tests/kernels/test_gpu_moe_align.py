"""`triton_moe_align` (the expert sort of the MoE paths) against its torch spec `moe_align_torch`: the same
sorted_ids (bit for bit past ONE_LAUNCH_PAIRS; up to it each expert's run holds the same pairs), block experts
and total, over several chunks and scan tiles, skewed routing
with experts nobody chose, absent experts (id E), and the inverse permutation pos.
Set-up: tests/kernels/gpu_common.py."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.gpu_common import DEVICE, gpu_modules, requires_gpu_kernels

pytestmark = requires_gpu_kernels


def _ids(gen, t: int, e: int, k: int, skewed: bool) -> torch.Tensor:
    probs = torch.linspace(8.0, 1.0, e, device=DEVICE) if skewed else torch.ones(e, device=DEVICE)
    probs[1] = 0.0  # expert 1: no tokens
    return torch.multinomial(probs.expand(t, e), k, replacement=False, generator=gen)


def _run_sorted(sorted_ids: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """sorted_ids with each expert's padded run (the slots up to its end in `ends`; past the last, the absent
    expert's run and the tail) in ascending id order: equal for two routes whose runs hold the same pairs."""
    slots = torch.arange(sorted_ids.numel(), device=sorted_ids.device)
    run = torch.searchsorted(ends.long(), slots, right=True)
    return torch.sort(run * (1 << 32) + sorted_ids.long()).values


@pytest.mark.parametrize("t,e,k,bm,chunk", [(1, 4, 1, 16, 1024), (37, 6, 3, 16, 1024), (90, 32, 8, 128, 64),
                                            (160, 256, 8, 64, 32), (128, 32, 8, 64, 1024), (256, 32, 8, 64, 1024)])
@pytest.mark.parametrize("skewed", [False, True])
@pytest.mark.parametrize("one_launch", [True, False])
def test_align_route_equals_the_torch_sort(gen, monkeypatch, t, e, k, bm, chunk, skewed, one_launch):
    """one_launch: up to ONE_LAUNCH_PAIRS pairs one program does it all (`_align_one_kernel`), else the three
    kernels (forced here for every size)."""
    gpu_modules()
    from dsaserve.kernels import triton_moe_align as A

    monkeypatch.setattr(A, "ALIGN_CHUNK", chunk)  # several chunks (and scan tiles) at interpreter sizes
    if not one_launch:
        monkeypatch.setattr(A, "ONE_LAUNCH_PAIRS", 0)
    ids = _ids(gen, t, e, k, skewed)
    if t > 1:
        ids[::7, 0] = e  # an absent expert's pairs: past the total, pos -1
    sorted_ids, bexp, total, pos, ends = A.align_route(ids, e, bm)
    want = A.moe_align_torch(ids, e, bm)
    assert torch.equal(ends, A.run_ends_torch(ids, e, bm)) and int(ends[-1]) == int(total), f"seed {gen.initial_seed()}"
    if one_launch:  # slots by atomics: each expert's run holds the same pairs, in no fixed order
        assert torch.equal(_run_sorted(sorted_ids, ends), _run_sorted(want[0], ends)), f"seed {gen.initial_seed()}"
    else:
        assert torch.equal(sorted_ids, want[0]), f"seed {gen.initial_seed()}"
    assert torch.equal(bexp, want[1]) and torch.equal(total, want[2]), f"seed {gen.initial_seed()}"
    flat = ids.reshape(-1)
    live = flat < e
    assert torch.equal(pos[~live], torch.full_like(pos[~live], -1))
    assert torch.equal(sorted_ids[pos[live].long()].long(), torch.nonzero(live).flatten())
    assert bool((pos[live] < total).all())


def test_align_route_takes_int32_ids_and_the_swap_kernel_path(gen):
    moe = gpu_modules()[3]
    from dsaserve.kernels import triton_moe_align as A

    ids = _ids(gen, 50, 8, 4, True).to(torch.int32)
    got = moe.moe_align(ids, 8, 16)
    want = A.moe_align_torch(ids.long(), 8, 16)
    ends = A.run_ends_torch(ids.long(), 8, 16)  # 200 pairs: one launch, each run's pairs in the atomics' order
    assert torch.equal(_run_sorted(got[0], ends), _run_sorted(want[0], ends)), f"seed {gen.initial_seed()}"
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]), f"seed {gen.initial_seed()}"
