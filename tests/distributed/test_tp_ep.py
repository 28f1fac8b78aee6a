"""Two gloo ranks on the CPU: the TP / EP model equals the single-rank model, and its counted collectives
are exactly the calls and message bytes the layout implies (and the ledger predicts for pure TP).

One spawn runs every (config, mode) on both ranks (tests/distributed/harness.py); the tests below assert
on what each rank recorded. Prefill logits at every position and 4 teacher-forced decode steps (the
single-rank model's greedy tokens) of a 3-request batch, plus the MTP layer's logits over one prompt;
float32 weights, fp32 KV.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from dsaserve.config import load_config
from dsaserve.ledger.collective_plan import step_plan
from dsaserve.ledger.deployment import Assumptions, Deployment
from tests.distributed.harness import CONFIGS, MODES, run_ranks, worker

N_DECODE = 4
ATOL = 1e-4  # float32: TP/EP only reorder sums (measured <= 2e-5 on logits of std ~4)
FP32 = 4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_ranks(worker, N_DECODE, tmp_path_factory.mktemp("ranks"))


def _expected(cfg, mode: str, tokens: int, rows: int, world: int = 2) -> tuple[Counter, Counter]:
    """kind -> calls and kind -> message bytes of one forward (all_to_all bytes: see the a2a test)."""
    kw = MODES[mode]
    tp, a2a = kw.get("tensor_parallel_size", 1), kw.get("moe_a2a", False)
    act = tokens * cfg.hidden_size * FP32
    padded = -(-tokens // world) * world * cfg.hidden_size * FP32  # a2a token chunks, padded to world rows
    n_moe = len(cfg.moe_layers)
    calls, nbytes = Counter(), Counter()

    def add(kind: str, n: int, message: int) -> None:
        calls[kind] += n
        nbytes[kind] += n * message

    if tp > 1:
        add("all_reduce", 1, act)  # vocab-parallel embedding
        add("all_reduce", cfg.num_hidden_layers, act)  # o_proj (row-parallel over heads)
        add("all_reduce", len(cfg.dense_layers), act)  # dense MLP down_proj
        add("all_gather", 1, rows * cfg.vocab_size * FP32)  # vocab-parallel logits
    if a2a:
        add("all_to_all", 2 * n_moe, 0)  # dispatch + combine
        add("all_gather", n_moe, padded)  # token chunks back to every rank
        if tp > 1:
            add("reduce_scatter", n_moe, padded)  # TP-split shared expert onto the chunks
    else:
        add("all_reduce", n_moe, act)  # routed parts (+ TP shared expert) summed once
    return calls, nbytes


def _measured(counters: dict, what: str) -> Counter:
    pre = f"collective_{what}."
    return Counter({k[len(pre):]: int(v) for k, v in counters.items() if k.startswith(pre)})


def _steps(res: dict, prompts_tokens: int) -> list[tuple[dict, int]]:
    """(counters, tokens) of the prefill and of each decode step (3 requests -> 3 tokens, 3 logits rows)."""
    return [(res["prefill"], prompts_tokens)] + [(d, 3) for d in res["decode"]]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", CONFIGS)
def test_prefill_and_decode_logits_match_the_single_rank_model(runs, name, mode):
    refs, ranks = runs
    for rank, res in enumerate(ranks):
        got = res[f"{name}/{mode}"]["logits"]
        assert len(got) == N_DECODE + 1
        for step, (mine, ref) in enumerate(zip(got, refs[name]["logits"], strict=True)):
            err = (mine - ref).abs().max().item()
            assert err < ATOL, (name, mode, rank, step, err)


@pytest.mark.parametrize("what", ["mtp_logits", "single_token"])  # single_token: a2a leaves rank 1 no tokens
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", CONFIGS)
def test_mtp_layer_and_one_token_step_logits_match_the_single_rank_model(runs, name, mode, what):
    refs, ranks = runs
    for res in ranks:
        err = (res[f"{name}/{mode}"][what] - refs[name][what]).abs().max().item()
        assert err < ATOL, (name, mode, what, err)


@pytest.mark.parametrize("mode", list(MODES))
def test_every_rank_returns_identical_logits(runs, mode):
    _, ranks = runs
    for name in CONFIGS:
        for a, b in zip(ranks[0][f"{name}/{mode}"]["logits"], ranks[1][f"{name}/{mode}"]["logits"], strict=True):
            assert torch.equal(a, b), (name, mode)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", CONFIGS)
def test_counted_collectives_are_the_layouts_calls_and_message_bytes(runs, name, mode):
    refs, ranks = runs
    cfg = load_config(name)
    prompt_tokens = refs[name]["logits"][0].shape[0]
    for res in ranks:
        for counters, tokens in _steps(res[f"{name}/{mode}"], prompt_tokens):
            calls, nbytes = _expected(cfg, mode, tokens, tokens)
            assert _measured(counters, "calls") == calls, (name, mode, tokens)
            measured = _measured(counters, "bytes")
            measured.pop("all_to_all", None)
            nbytes.pop("all_to_all", None)
            assert measured == +nbytes, (name, mode, tokens)
            wire = _measured(counters, "wire_bytes")  # 2 ranks: ring all-reduce 2(n-1)/n = 1, gathers 1/2
            assert wire["all_reduce"] == measured["all_reduce"]
            assert 2 * wire["all_gather"] == measured["all_gather"]
            assert 2 * wire["reduce_scatter"] == measured["reduce_scatter"]


@pytest.mark.parametrize("mode", ["ep2_a2a", "tp2_ep2_a2a"])
@pytest.mark.parametrize("name", CONFIGS)
def test_a2a_dispatch_and_combine_send_every_token_to_its_k_experts(runs, name, mode):
    """Summed over ranks, dispatch and combine each move T x k hidden rows per MoE layer (the ledger's
    sender total); wire bytes exclude the rows a rank keeps for its own experts."""
    refs, ranks = runs
    cfg = load_config(name)
    prompt_tokens = refs[name]["logits"][0].shape[0]
    per_rank = [_steps(res[f"{name}/{mode}"], prompt_tokens) for res in ranks]
    for (c0, tokens), (c1, _) in zip(*per_rank, strict=True):
        total = c0["collective_bytes.all_to_all"] + c1["collective_bytes.all_to_all"]
        assert total == 2 * len(cfg.moe_layers) * tokens * cfg.num_experts_per_tok * cfg.hidden_size * FP32
        for c in (c0, c1):
            assert 0 < c["collective_wire_bytes.all_to_all"] <= c["collective_bytes.all_to_all"]


@pytest.mark.parametrize("name", CONFIGS)
def test_pure_tp_counts_equal_the_ledger_prediction(runs, name):
    """Reconcile: the ledger's TP2 collective plan (FP32 activations here) is what the engine counted."""
    refs, ranks = runs
    cfg = load_config(name)
    prompt_tokens = refs[name]["logits"][0].shape[0]
    asm = Assumptions(act_bytes=FP32, logits_bytes=FP32)
    for counters, tokens in _steps(ranks[0][f"{name}/tp2"], prompt_tokens):
        plan = step_plan(cfg, Deployment(tp=2), asm, tokens=tokens, logits_rows=tokens)
        for kind in {r.kind for r in plan}:
            rows = [r for r in plan if r.kind == kind]
            assert counters[f"collective_calls.{kind}"] == sum(r.calls for r in rows)
            assert counters[f"collective_bytes.{kind}"] == sum(r.total_message for r in rows)
            assert counters[f"collective_wire_bytes.{kind}"] == pytest.approx(sum(r.wire_bytes for r in rows))


@pytest.mark.parametrize("mode", ["ep2", "tp2_ep2", "ep2_a2a"])
@pytest.mark.parametrize("name", CONFIGS)
def test_ep_loader_skips_exactly_the_other_ranks_experts(runs, name, mode):
    _, ranks = runs
    cfg = load_config(name)
    per_rank = cfg.n_routed_experts // 2
    suffixes = ("weight", "weight_scale_inv")
    for rank, res in enumerate(ranks):
        skipped = res[f"{name}/{mode}"]["not_loaded"]
        others = range((1 - rank) * per_rank, (2 - rank) * per_rank)
        want = {f"model.layers.{layer}.mlp.experts.{j}.{p}_proj.{s}" for layer in (*cfg.moe_layers, *cfg.mtp_layer_ids)
                for j in others for p in ("gate", "up", "down") for s in suffixes}
        assert set(skipped) == want  # MTP layer loaded here; nothing else skipped
        assert all(f"held by EP rank {1 - rank} of 2" in why for why in skipped.values())


def test_manifest_names_the_backend_layout_and_warmed_collectives(runs):
    _, ranks = runs
    for rank, res in enumerate(ranks):
        par = res["glm-5.3-tiny/tp2_ep2"]["manifest_parallel"]
        assert (par["backend"], par["world_size"], par["rank"], par["tp_size"], par["ep_size"]) == \
            ("gloo", 2, rank, 2, 2)
        assert par["warmed_collectives"] == ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                                             "all_reduce <= 2 MiB: NCCL (device cpu)"]  # gloo: no symmetric memory


def test_collective_wrappers_move_the_right_rows_and_count_sender_bytes(runs):
    _, ranks = runs
    x = [torch.arange(12.0).view(3, 4) + 100 * r for r in range(2)]
    for rank, res in enumerate(ranks):
        p = res["probe"]
        assert torch.equal(p["all_reduce"], x[0] + x[1])
        assert torch.equal(p["all_gather_dim1"], torch.cat(x, dim=1))
        into, buf = p["all_gather_into"]
        assert into and torch.equal(buf, torch.cat(x, dim=1))
        assert torch.equal(p["reduce_scatter_dim1"], (x[0] + x[1])[:, 2 * rank:2 * rank + 2])
        want_a2a = torch.cat([x[0][:1], x[1]]) if rank == 0 else x[0][1:]
        assert torch.equal(p["all_to_all"], want_a2a)
        assert torch.equal(p["broadcast"], x[1])
        c = p["counters"]
        msg = 12 * FP32
        assert all(c[f"collective_calls.{k}"] == 1 for k in ("all_reduce", "all_gather", "reduce_scatter",
                                                               "all_to_all", "broadcast"))
        assert (c["collective_bytes.all_reduce"], c["collective_wire_bytes.all_reduce"]) == (msg, msg)
        assert (c["collective_bytes.all_gather"], c["collective_wire_bytes.all_gather"]) == (2 * msg, msg)
        assert (c["collective_bytes.reduce_scatter"], c["collective_wire_bytes.reduce_scatter"]) == (msg, msg / 2)
        assert (c["collective_bytes.broadcast"], c["collective_wire_bytes.broadcast"]) == (msg, msg / 2)
        sent_to_other = 2 * 4 * FP32 if rank == 0 else msg  # rank 0 keeps one of its 3 rows
        assert (c["collective_bytes.all_to_all"], c["collective_wire_bytes.all_to_all"]) == (msg, sent_to_other)
