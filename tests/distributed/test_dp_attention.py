"""DP2 + EP2 on two gloo ranks: each rank runs its own requests (uneven token counts; at some steps none,
through `forward_idle`) and its logits equal the single-rank model's for those requests; its counted
collectives are exactly the ledger's plan for the layout and the step the ranks agreed on (dsaserve's
DP-attention, engine/dp_step.py: decodes take the graph-sized gather, `dp_moe="padded"`; with a step budget
of 64 tokens rank 1's 41-token prefill takes the eager gather and rank 0's 75 tokens the all-to-all exchange,
`dp_moe="a2a"`). Scenario: tests/distributed/dp_harness.py. float32 weights, fp32 KV.
"""

from __future__ import annotations

import pytest

from dsaserve.config import load_config
from dsaserve.ledger.collective_plan import step_plan
from dsaserve.ledger.deployment import Assumptions, Deployment
from tests.distributed.dp_harness import dp_worker, expected_logits
from tests.distributed.harness import CONFIGS, prompts_for, run_ranks

N_DECODE = 3
ATOL = 1e-4  # as test_tp_ep.py: only the order of sums changes
FP32 = 4
DEP = Deployment(tp=2, ep=2, dp_attention=True)
ASM = Assumptions(dp_moe="a2a", act_bytes=FP32, dispatch_bytes=FP32, combine_bytes=FP32, logits_bytes=FP32)
PADDED = Assumptions(dp_moe="padded", act_bytes=FP32)
BUDGET = 64  # the runs' max_num_batched_tokens: an eager gather step's busiest rank holds at most this many


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(dp_worker, N_DECODE, tmp_path_factory.mktemp("dp_ranks"), max_num_batched_tokens=BUDGET)


@pytest.mark.parametrize("name", CONFIGS)
def test_each_rank_gets_the_single_rank_logits_of_its_own_requests(runs, name):
    refs, ranks = runs
    cfg = load_config(name)
    for rank, res in enumerate(ranks):
        steps = res[name]["steps"]
        assert sum(s["what"][0] == "idle" for s in steps) == (3 if rank == 1 else 2)  # both idle at some step
        for i, s in enumerate(steps):
            if s["what"][0] == "idle":
                assert s["logits"] is None
                continue
            err = (s["logits"] - expected_logits(refs[name], cfg, rank, s["what"])).abs().max().item()
            assert err < ATOL, (name, rank, i, s["what"], err)


def _by_kind(plan) -> dict[str, tuple[float, float]]:
    return {f"collective_{w}.{r.kind}": v for r in plan for w, v in (("calls", r.calls), ("bytes", r.total_message))}


@pytest.mark.parametrize("name", CONFIGS)
def test_the_ranks_agree_on_each_step_and_every_path_runs(runs, name):
    """The rule (engine/dp_step.py): decode-only steps, idle rank or not -> a graph gather step at the bucket of
    the busiest rank (rank 0's 2 tokens: bucket 2, rank 1 pads 1 row, or 2 when idle; rank 1 alone: bucket 1);
    a prefill -> an eager gather of the busiest rank's tokens while they fit the step budget the memory profile
    sized, else the all-to-all exchange."""
    _, ranks = runs
    paths = set()
    for a, b in zip(ranks[0][name]["steps"][:-1], ranks[1][name]["steps"][:-1], strict=True):
        step = a["dp_step"]
        assert step == b["dp_step"] and step.tokens == (a["tokens"], b["tokens"])
        busiest = max(step.tokens)  # decode: 1 or 2, buckets of their own
        if "prefill" not in (a["what"][0], b["what"][0]):
            want = ("gather", busiest, True)
        else:
            want = ("a2a", 0, False) if busiest > BUDGET else ("gather", busiest, False)
        assert (step.mode, step.rows, step.graph) == want, a["what"]
        paths.add(want[::2])
    assert paths == {("gather", True), ("gather", False), ("a2a", False)}


@pytest.mark.parametrize("name", CONFIGS)
def test_counted_collectives_equal_the_ledger_plan_for_dp_attention(runs, name):
    """Per step: every rank (busy or idle) makes the plan's calls of the agreed mode and nothing else. Exchange
    steps: the all_to_all bytes summed over both ranks are the plan's sender totals for all the step's tokens;
    gather steps: each rank's all_gather / reduce_scatter bytes are the plan's, dp x the padded rows."""
    _, ranks = runs
    cfg = load_config(name)
    steps = list(zip(ranks[0][name]["steps"], ranks[1][name]["steps"], strict=True))
    for i, (a, b) in enumerate(steps[:-1]):  # the last step is the MTP one, below
        tokens, step = a["tokens"] + b["tokens"], a["dp_step"]
        if step.mode == "gather":
            want = _by_kind(step_plan(cfg, DEP, PADDED, tokens=tokens, rank_rows=step.rows))
            assert set(want) == {f"collective_{w}.{k}" for w in ("calls", "bytes")
                                 for k in ("all_gather", "reduce_scatter")}
            for c in (a["counters"], b["counters"]):
                assert {k: v for k, v in c.items() if not k.startswith("collective_wire")} == want, (name, i)
            continue
        plan = step_plan(cfg, DEP, ASM, tokens=tokens)
        assert {r.kind for r in plan} == {"all_to_all"}
        for c in (a["counters"], b["counters"]):
            assert {k for k in c if k.startswith("collective_calls.")} == {"collective_calls.all_to_all"}
            assert c["collective_calls.all_to_all"] == sum(r.calls for r in plan), (name, i)
        sent = a["counters"]["collective_bytes.all_to_all"] + b["counters"]["collective_bytes.all_to_all"]
        assert sent == sum(r.total_message for r in plan), (name, i)
    mtp = step_plan(cfg, DEP, ASM, tokens=len(prompts_for(cfg)[0]), mtp=True)
    for c in (steps[-1][0]["counters"], steps[-1][1]["counters"]):  # main forward + MTP layer (idle: both)
        assert c["collective_calls.all_to_all"] == sum(r.calls for r in mtp)


@pytest.mark.parametrize("name", CONFIGS)
def test_dp_attention_layout_is_recorded_and_experts_are_split(runs, name):
    cfg = load_config(name)
    layouts = {k: tuple(r[name]["parallel"][k] for r in runs[1]) for k in ("dp_attention", "dp_size", "tp_size",
                                                                         "ep_size", "moe_a2a", "rank", "dp_moe")}
    assert layouts == {"dp_attention": (True, True), "dp_size": (2, 2), "tp_size": (1, 1), "ep_size": (2, 2),
                       "moe_a2a": (True, True), "rank": (0, 1), "dp_moe": ("auto", "auto")}
    # each rank skips the other's half of the routed experts (gate, up, down; weight + scale) of every MoE layer
    want = (len(cfg.moe_layers) + len(cfg.mtp_layer_ids)) * cfg.n_routed_experts // 2 * 3 * 2
    for other, saved in ((1, runs[1][0]), (0, runs[1][1])):
        why = saved[name]["not_loaded"].values()
        assert len(why) == want and all(f"held by EP rank {other} of 2" in w for w in why)
