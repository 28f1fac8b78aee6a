"""Speculative decoding in the ledger: the forwards of a verify step, its bytes and collectives, tokens a step,
the break-even acceptance, the report section and the flags."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from dsaserve.cli import main
from dsaserve.config import load_config
from dsaserve.ledger.deployment import MAX_DRAFTS, Assumptions, Deployment, Workload
from dsaserve.ledger.hardware import PRESETS
from dsaserve.ledger.inputs import LedgerInputs
from dsaserve.ledger.marginal import decode_step, marginal
from dsaserve.ledger.sections_speculative import speculative, step_with
from dsaserve.ledger.speculative import break_even_acceptance, expected_tokens, step_forwards
from dsaserve.ledger.timeline import operator_list
from dsaserve.ledger.weights import inventory, stored_per_gpu

GLM = load_config("glm-5.3")
INV = inventory(GLM)
TP8 = Deployment(tp=8)
B, CTX = 32, 131072


def _step(k: int, **asm):
    a = Assumptions(speculative=k > 0, speculative_num_steps=max(k, 1), **asm)
    return decode_step(GLM, INV, TP8, PRESETS["h200"], a, "fp8_ds_mla", B, CTX)


def test_expected_tokens_is_the_geometric_sum_of_kept_drafts():
    assert expected_tokens(0, 0.7) == 1
    assert expected_tokens(3, 1.0) == 4 and expected_tokens(3, 0.0) == 1
    assert expected_tokens(2, 0.5) == pytest.approx(1.75)
    assert expected_tokens(8, 0.9) == pytest.approx((1 - 0.9 ** 9) / (1 - 0.9))
    # by position: draft 2 kept with 0.6 x 0.5, draft 3 with 0.6 x 0.5 x 0.5 (the last rate repeats)
    assert expected_tokens(3, (0.6, 0.5)) == pytest.approx(1 + 0.6 + 0.3 + 0.15)
    assert expected_tokens(2, [0.7]) == expected_tokens(2, 0.7)


def test_rates_by_position_replace_the_one_rate():
    a = Assumptions(speculative=True, speculative_num_steps=3, draft_acceptance=0.9,
                    draft_acceptance_by_position="0.6,0.5")
    st = decode_step(GLM, INV, TP8, PRESETS["h200"], a, "fp8_ds_mla", B, CTX)
    assert st.tokens_per_request == pytest.approx(1.6 + 0.3 + 0.15)


def test_a_verify_step_is_the_main_forward_over_one_plus_k_tokens_then_k_mtp_forwards():
    plain = step_forwards(32, 0, 0.5)
    assert [(f.part, f.tokens, f.queries, f.logits_rows) for f in plain] == [("main", 32, 1, 32)]
    fwds = step_forwards(32, 3, 0.5)
    assert [(f.part, f.tokens, f.logits_rows) for f in fwds] == [("main", 128, 128), ("mtp", 60, 32),
                                                                  ("mtp", 32, 32), ("mtp", 32, 32)]
    assert fwds[0].queries == 4 and fwds[1].queries == pytest.approx(1.875)


def test_collectives_add_one_embedding_attention_moe_and_logits_call_a_draft_forward():
    plain, spec = _step(0), _step(2)
    # TP8 plain: embedding 1 + o_proj 78 + dense MLP 3 + MoE 75 reductions, one logits gather
    assert plain.term("reductions").calls == 157 and plain.term("lm_gather").calls == 1
    assert spec.term("reductions").calls == 157 + 2 * 3 and spec.term("lm_gather").calls == 1 + 2
    rows = B * 3 + 2 * B  # the verify's logits at 3 rows a request, each draft forward's at one
    assert spec.term("lm_gather").bytes == pytest.approx(rows * GLM.vocab_size * 4 * 7 / 8)
    # the verify's 3 tokens a request; the MTP layer's first forward over round(32 x 2.44) = 78 tokens, then 32
    mtp_tokens = round(B * expected_tokens(2, 0.8)) + B
    assert spec.term("reductions").bytes == pytest.approx(plain.term("reductions").bytes * 3
                                                          + 3 * mtp_tokens * GLM.hidden_size * 2 * 2 * 7 / 8)


@pytest.mark.parametrize("gather", ["slots", "rows"])
def test_kv_and_indexer_reads_of_the_verify_and_the_draft_forwards(gather: str):
    st = _step(2, draft_acceptance=0.5, prefill_kv_gather=gather)
    e = 1.75  # tokens a request a step at k = 2, a = 0.5: the MTP layer's first forward covers them
    main_rows = 3 * 2048 if gather == "slots" else 2048 + 2
    mtp_rows = (e * 2048 if gather == "slots" else 2048 + e - 1) + 2048
    assert st.term("kv").bytes == pytest.approx(B * 656 * (main_rows * 78 + mtp_rows))
    # the verify's 3 rows a request each score its keys (decode rows); the MTP layer once in each of its forwards
    assert st.term("indexer").bytes == pytest.approx(B * CTX * 132 * (21 * 3 + 2))


def test_each_draft_forward_reads_the_mtp_layer_and_the_lm_head():
    a = Assumptions(expert_routing="all")  # every expert read whatever the tokens: only the MTP forwards differ
    plain, spec = _step(0, expert_routing="all"), _step(3, expert_routing="all")
    stored = stored_per_gpu(INV, TP8, replace(a, speculative=True))
    mtp_layer = sum(b for g, b in stored.items() if g.startswith("mtp.") and g != "mtp.embed")
    lm_head = GLM.vocab_size * GLM.hidden_size * 2 / 8  # bf16, vocab-parallel over TP8
    assert stored["lm_head"] == pytest.approx(lm_head)
    assert spec.term("weights").bytes - plain.term("weights").bytes == pytest.approx(3 * (mtp_layer + lm_head))


def test_per_token_costs_divide_by_the_tokens_a_step_emits():
    st = _step(3, draft_acceptance=0.6)
    e = expected_tokens(3, 0.6)
    assert st.tokens_per_request == pytest.approx(e)
    m = marginal(st)
    assert m.weights_s == pytest.approx(st.ledger("weights") / (B * e))
    assert m.comm_s == pytest.approx(st.ledger("comm") / (B * e)) and m.step_s == st.serial_s


def test_speculation_costs_more_a_step_and_pays_only_with_kept_drafts():
    plain = _step(0).serial_s
    never, always = _step(1, draft_acceptance=0.0), _step(1, draft_acceptance=1.0)
    assert never.serial_s > plain  # drafts nobody keeps: the verify and the MTP forward are pure cost
    assert never.serial_s / never.tokens_per_request > plain
    assert always.serial_s / always.tokens_per_request < plain < always.serial_s  # 2 tokens for < 2 steps


def test_break_even_acceptance_makes_the_speedup_one():
    li = LedgerInputs(GLM, TP8, PRESETS["h200"], Workload(batch=B, decode_context=CTX), Assumptions())
    sec = speculative(li)
    assert [r["drafts"] for r in sec.rows] == list(range(MAX_DRAFTS + 1))
    for row in sec.rows[1:4]:
        even = row["break_even"]
        at = replace(li, asm=replace(li.asm, draft_acceptance=even))
        st, plain = step_with(at, row["drafts"]), step_with(at, 0)
        assert plain.serial_s / (st.serial_s / st.tokens_per_request) == pytest.approx(1.0, abs=1e-3)
    assert sec.rows[0]["speedup"] == 1 and sec.rows[0]["break_even"] is None


def test_break_even_is_none_when_even_every_draft_kept_does_not_pay():
    assert break_even_acceptance(lambda a: 3.5, 2) is None
    assert break_even_acceptance(lambda a: 1.5, 1) == pytest.approx(0.5, abs=1e-4)
    assert break_even_acceptance(lambda a: 1.2 + 0.2 * a, 1) == pytest.approx(0.25, abs=1e-4)  # 1 + a = 1.2 + 0.2a


def test_the_operator_list_counts_one_mtp_forward_a_draft():
    ops = {o.no: o for o in operator_list(GLM, TP8, Assumptions(speculative=True, speculative_num_steps=3))}
    assert ops[15].decode == 3
    assert {o.no: o for o in operator_list(GLM, TP8, Assumptions())}[15].decode == 0


def test_the_ledger_allows_the_engines_draft_limit():
    from dsaserve.engine.engine_args import MAX_SPECULATIVE_STEPS

    assert MAX_DRAFTS == MAX_SPECULATIVE_STEPS


def test_cli_flags_turn_speculation_on_and_name_themselves_in_errors(capsys):
    rc = main(["ledger", "--json", "--sections", "speculative,weights_per_gpu", "--speculative-num-steps", "3",
               "--draft-acceptance", "0.7"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["assumptions"]["speculative"] is True and d["assumptions"]["speculative_num_steps"] == 3
    rows = d["sections"]["speculative"]["rows"]
    assert rows[3]["tokens"] == pytest.approx(expected_tokens(3, 0.7)) and len(rows) == MAX_DRAFTS + 1
    groups = {r["group"] for r in d["sections"]["weights_per_gpu"]["rows"]}
    assert "mtp.experts" in groups  # the MTP layer is stored with speculation on
    main(["ledger", "--json", "--sections", "speculative", "--draft-acceptance", "0.6,0.5"])
    d = json.loads(capsys.readouterr().out)
    assert d["assumptions"]["draft_acceptance_by_position"] == "0.6,0.5"
    assert d["sections"]["speculative"]["rows"][3]["tokens"] == pytest.approx(2.05)
    for argv, flag in ((["--speculative-num-steps", "9"], "--speculative-num-steps"),
                       (["--draft-acceptance", "0.5,x"], "--draft-acceptance"),
                       (["--draft-acceptance", "1.5"], "--draft-acceptance"),
                       (["--assume", "speculative_num_steps=0"], "--assume speculative_num_steps")):
        assert main(["ledger", "--sections", "speculative", *argv]) == 2
        assert capsys.readouterr().err.startswith(f"dsaserve ledger: error: {flag}: ")
