"""Reconcile: the scheduler replay, predicted vs measured rows, run files, and the real tiny engine."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dsaserve.config import load_config
from dsaserve.ledger.reconcile import (
    Row,
    RunRecord,
    RunShape,
    fixed_weight_bytes,
    load_run,
    predict_run,
    query_weight_bytes,
    reconcile,
    run_from_dict,
    simulate_schedule,
)

TINY = load_config("glm-5.3-tiny")  # kv_lora 128, rope 16, index dim 32: 164 B and 36 B per token per layer
ENGINE = Path(__file__).resolve().parents[2] / "dsaserve" / "engine" / "engine.py"


def test_schedule_prefills_together_then_decodes_max_tokens_minus_one_steps():
    steps = simulate_schedule(RunShape((5, 17), 4))
    assert steps[0] == [Row(0, 5), Row(0, 17)]
    assert steps[1:] == [[Row(5 + i, 1), Row(17 + i, 1)] for i in range(3)]


def test_schedule_chunks_prompts_under_the_budget_and_decodes_first():
    steps = simulate_schedule(RunShape((10, 30), 3, max_num_batched_tokens=16, chunked_prefill_size=12))
    assert steps[0] == [Row(0, 10), Row(0, 6)]  # request 2 gets what the budget leaves
    assert steps[1] == [Row(10, 1), Row(6, 12)]  # request 1 decodes first, request 2 continues its prompt
    assert steps[2] == [Row(11, 1), Row(18, 12)]
    assert sum(r.new for s in steps for r in s) == 10 + 30 + 2 * (3 - 1)


def test_prediction_of_the_deterministic_terms():
    p = predict_run(TINY, RunShape((5, 70), 3))
    tokens = 5 + 70 + 2 * 2
    assert p["forward_steps"].value == 3
    assert p["kv_bytes_written"].value == tokens * 164 * 6
    assert p["indexer_bytes_written"].value == tokens * 36 * 3
    # top-k 8: a query at position p reads min(8, p + 1) slots
    slots = sum(min(8, q + 1) for n in (5, 70) for q in range(n + 2))
    assert p["kv_bytes_read"].value == slots * 164 * 6
    keys = sum(q + 1 for n in (5, 70) for q in range(n + 2))
    assert p["indexer_bytes_read"].value == keys * 36 * 3
    assert p["collective_calls.all_reduce"].value == 0


def test_weight_range_spans_the_routing_extremes():
    p = predict_run(TINY, RunShape((5,), 2))["weight_bytes_read"]
    fixed, expert = fixed_weight_bytes(TINY)
    assert p.lo == 2 * fixed + 4 * expert * (2 + 2)  # >= k = 2 distinct experts per layer per forward
    assert p.hi == 2 * fixed + 4 * expert * (8 + 2)  # 5 tokens x 2 -> all 8; 1 token x 2 -> 2
    assert p.lo < p.value < p.hi
    exact = predict_run(TINY, RunShape((5,), 2), experts_touched=37)["weight_bytes_read"]
    assert exact.exact and exact.value == 2 * fixed + 37 * expert


def test_reconcile_rows_pass_exact_counts_and_catch_one_byte_off():
    pred = predict_run(TINY, RunShape((5, 17), 3))
    counters = {k: v.value for k, v in pred.items()}
    rows = reconcile(pred, counters)
    assert all(r.ok for r in rows) and all(r.ratio == 1.0 for r in rows)
    counters["kv_bytes_written"] += 1
    counters["collective_calls.all_to_all"] = 2
    bad = {r.term: r for r in reconcile(pred, counters)}
    assert bad["kv_bytes_written"].ok is False
    assert bad["collective_calls.all_to_all"].ok is False  # a collective the ledger does not expect
    counters["weight_bytes_read"] = pred["weight_bytes_read"].hi * 1.01
    assert {r.term: r for r in reconcile(pred, counters)}["weight_bytes_read"].ok is False


def test_pool_terms_need_the_pool_info():
    run = RunRecord("glm-5.3-tiny", RunShape((5,), 2), {}, {"num_pages": 10, "page_size": 64, "num_tokens": 640,
                                                         "bytes_per_token": 164 * 6 + 36 * 3})
    rows = {r.term: r for r in run.rows()}
    assert rows["kv_pool.num_tokens"].ok and rows["kv_pool.bytes_per_token"].ok
    assert rows["kv_pool.total_bytes"].measured is None and rows["kv_pool.total_bytes"].ok is None


def test_a_sink_page_counts_in_the_pool_bytes_but_not_its_tokens():
    pool = {"num_pages": 10, "page_size": 64, "num_tokens": 640, "total_bytes": 11 * 64 * 1092}
    run = RunRecord("glm-5.3-tiny", RunShape((5,), 2, sink_pages=1), {}, pool)
    rows = {r.term: r for r in run.rows()}
    assert rows["kv_pool.total_bytes"].ok and rows["kv_pool.num_tokens"].ok
    assert not {r.term: r for r in RunRecord("glm-5.3-tiny", RunShape((5,), 2), {}, pool).rows()}[
        "kv_pool.total_bytes"].ok


def test_run_file_round_trip_and_errors(tmp_path):
    run = RunRecord("glm-5.3-tiny", RunShape((5, 9), 2, "bf16"), {"forward_steps": 2.0}, {"num_pages": 4})
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run.to_dict()))
    back = load_run(path)
    assert back.shape == run.shape and back.counters == run.counters and back.kv_pool == run.kv_pool
    d = run.to_dict()
    for broken, msg in [({**d, "workload": {**d["workload"], "prompt_lens": [0]}}, "workload.prompt_lens"),
                        ({**d, "workload": {**d["workload"], "kv_layout": "int3"}}, "workload.kv_layout"),
                        ({**d, "workload": {**d["workload"], "colour": 1}}, "workload.colour: unknown field"),
                        ({k: v for k, v in d.items() if k != "counters"}, "missing 'counters'"),
                        ({**d, "counters": {"forward_steps": "many"}}, "counters: expected"),
                        ({**d, "bogus": 1}, "run file bogus: unknown field"),
                        ({**d, "deployment": {"tp": 1, "pp": 2}}, "run file deployment.pp: unknown field"),
                        ({**d, "counters": {"weird_counter": 1}}, "counters.weird_counter: unknown counter"),
                        ({**d, "counters": {"collective_calls.teleport": 1}}, "counters.collective_calls.teleport")]:
        with pytest.raises(ValueError, match=msg):
            run_from_dict(broken)
    engine_written = {**d, "engine_stats": {"steps": 2}, "device": "cpu",  # what cli/reconcile_driver adds
                      "counters": {"collective_calls.all_reduce": 3, "eager_fallbacks.moe_a2a": 0}}
    assert run_from_dict(engine_written).extra == {"engine_stats": {"steps": 2}, "device": "cpu"}
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        load_run(tmp_path / "bad.json")


def test_saved_run_file_reconciles_through_the_cli(tmp_path, capsys):
    from dsaserve.cli import main

    pred = predict_run(TINY, RunShape((5, 17), 3))
    run = RunRecord("glm-5.3-tiny", RunShape((5, 17), 3), {k: v.value for k, v in pred.items()})
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run.to_dict()))
    assert main(["ledger", "--reconcile", str(path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sections"]["reconcile"]["rows"]
    assert rows and all(r["ok"] for r in rows)
    run.counters["forward_steps"] = 4
    path.write_text(json.dumps(run.to_dict()))
    assert main(["ledger", "--reconcile", str(path)]) == 1  # a failing term fails the command
    capsys.readouterr()


@pytest.mark.skipif(not ENGINE.exists(), reason="dsaserve/engine/engine.py (the offline Engine) has not landed yet")
def test_reconcile_runs_the_tiny_engine_and_matches_the_prediction(tmp_path, capsys):
    """`dsaserve ledger --reconcile` on glm-5.3-tiny: counts and deterministic bytes exact, weights in range."""
    from dsaserve.cli import main

    saved = tmp_path / "run.json"
    rc = main(["ledger", "--reconcile", "--reconcile-model", "glm-5.3-tiny", "--reconcile-prompts", "5,17,70",
               "--reconcile-max-tokens", "6", "--save-run", str(saved), "--json"])
    rows = {r["term"]: r for r in json.loads(capsys.readouterr().out)["sections"]["reconcile"]["rows"]}
    for term in ("forward_steps", "kv_bytes_written", "indexer_bytes_written", "kv_bytes_read",
                 "indexer_bytes_read", "kv_pool.num_tokens", "kv_pool.bytes_per_token", "kv_pool.total_bytes",
                 "kv_pool.kv_layers", "kv_pool.indexer_layers", "collective_calls.all_reduce"):
        assert rows[term]["measured"] == rows[term]["predicted"], (term, rows[term])
    assert rows["forward_steps"]["measured"] == 6  # one prefill of all three prompts + 5 decode steps
    assert rows["weight_bytes_read"]["ok"], rows["weight_bytes_read"]
    assert rc == 0, [r for r in rows.values() if r["ok"] is False]
    again = load_run(saved)  # the saved run reconciles offline to the same verdict
    assert again.shape.prompt_lens == (5, 17, 70) and all(r.ok is not False for r in again.rows())


def test_forwards_within_the_top_k_score_no_key_and_skip_the_query_weights():
    """Pages of 4 against TINY's top-8: a forward two pages wide takes every key (common/causal.takes_every_key)."""
    shape = RunShape((5, 3), 4, page_size=4)  # widths: 2 pages (5 keys), 2 (6), 2 (7), 2 (8): every step
    p, wide = predict_run(TINY, shape), predict_run(TINY, dataclasses.replace(shape, page_size=64))
    assert p["indexer_bytes_read"].value == 0 < wide["indexer_bytes_read"].value
    queries = query_weight_bytes(TINY)
    assert queries > 0
    assert wide["weight_bytes_read"].lo - p["weight_bytes_read"].lo == 4 * queries
    assert p["kv_bytes_read"].value == wide["kv_bytes_read"].value  # every selected slot is still read
    longer = predict_run(TINY, RunShape((5, 3), 6, page_size=4))  # decodes to 9 and 10 keys: 3 pages
    assert longer["indexer_bytes_read"].value == ((9 + 7) + (10 + 8)) * 36 * 3  # each row scores its keys


def test_the_forward_width_follows_the_graphs():
    shape = RunShape((5,), 2, page_size=4, decode_graph_widths=(2, 16), decode_graph_max_bs=8, segment_tokens=32)
    assert shape.forward_width([Row(0, 5)]) == (16, True)  # a piecewise core: 2 pages padded to 16
    assert shape.forward_width([Row(0, 40)]) == (10, False)  # over the buckets: eager at its own width
    assert shape.forward_width([Row(5, 1)]) == (2, False)  # the narrow decode class
    assert shape.forward_width([Row(9, 1)]) == (16, False)  # 3 pages: the wide class
    assert shape.forward_width([Row(5, 1)] * 9) == (16, True)  # over max_bs: the piecewise graphs take it
    assert shape.forward_width([Row(70, 1)]) == (32, True)  # past every class: piecewise, 18 pages padded to 32
    assert shape.forward_width([Row(70, 1)] * 33) == (18, False)  # past both: eager at its own width
    no_decode = dataclasses.replace(shape, decode_graph_widths=())  # decode capture failed: piecewise
    assert no_decode.forward_width([Row(5, 1)]) == (16, True)
    with pytest.raises(ValueError, match="decode_graph_widths"):
        dataclasses.replace(shape, decode_graph_widths=(0,))
    with pytest.raises(ValueError, match="segment_tokens"):
        dataclasses.replace(shape, segment_tokens=-1)
    with pytest.raises(ValueError, match="workload.decode_graph_widths"):
        run_from_dict({"config": "glm-5.3-tiny", "counters": {},
                       "workload": {"prompt_lens": [5], "max_tokens": 2, "decode_graph_widths": "ab"}})
    segments = predict_run(TINY, shape)
    eager = predict_run(TINY, dataclasses.replace(shape, decode_graph_widths=(), segment_tokens=0))
    # the prefill runs as segments (queries computed) 16 pages wide (keys scored); the decode skips both either way
    assert segments["weight_bytes_read"].lo - eager["weight_bytes_read"].lo == query_weight_bytes(TINY)
    assert segments["indexer_bytes_read"].value == sum(q + 1 for q in range(5)) * 36 * 3
    assert eager["indexer_bytes_read"].value == 0


@pytest.mark.skipif(not ENGINE.exists(), reason="dsaserve/engine/engine.py (the offline Engine) has not landed yet")
def test_reconcile_of_a_run_within_the_top_k_is_exact(capsys):
    """glm-5.3-mini selects top-64, a page: prompts up to 60 tokens run within it until the longest passes 64 keys.
    The engine's counters follow what its forwards called; the prediction replays the rule."""
    from dsaserve.cli import main

    rc = main(["ledger", "--reconcile", "--reconcile-model", "glm-5.3-mini", "--reconcile-prompts", "5,17,60",
               "--reconcile-max-tokens", "8", "--json"])
    rows = {r["term"]: r for r in json.loads(capsys.readouterr().out)["sections"]["reconcile"]["rows"]}
    assert rc == 0, [r for r in rows.values() if r["ok"] is False]
    for term in ("indexer_bytes_read", "weight_bytes_read", "kv_bytes_read"):
        assert rows[term]["measured"] == rows[term]["predicted"], (term, rows[term])
    assert "none in the 5 forwards within the top-k" in rows["indexer_bytes_read"]["why"]
    # the last 3 decodes run 2 pages wide (the longest row at 65-67 keys), and each of their rows scores its keys
    assert rows["indexer_bytes_read"]["measured"] == ((65 + 10 + 22) + (66 + 11 + 23) + (67 + 12 + 24)) * 68 * 3


def test_all_to_all_bytes_are_rank_zeros_own_chunk_of_the_tokens():
    # engine/expert_parallel.a2a_moe_forward: rank 0 sends the (token, expert) pairs of its ceil(T/ep) tokens
    def a2a(prompt: int) -> float:
        return predict_run(TINY, RunShape((prompt,), 1, tp=2, ep=2))["collective_bytes.all_to_all"].value

    assert a2a(5) == a2a(6)  # ceil(5/2) = ceil(6/2) = 3 tokens
    assert a2a(7) == pytest.approx(a2a(6) * 4 / 3)  # ceil(7/2) = 4
    assert a2a(6) == 4 * 3 * 2 * 256 * (1 + 2)  # 4 MoE layers x 3 tokens x top-2 x hidden 256 x (FP8 + BF16)


def test_prefill_staging_bytes_follow_the_engines_rule():
    """A GPU run stages steps of >= 512 tokens whose requests' pages hold <= 8 rows a token (common/causal.py's rule,
    the engine's too): per main-KV layer each staged row is read (656 B, fp8_ds_mla) and written as bf16 (1152 B)."""
    slice_cfg = load_config("glm-5.3-slice")  # kv_lora 512 + rope 64
    shape = RunShape((600, 20), 3, "fp8_ds_mla", "bfloat16", max_num_batched_tokens=4096, prefill_staging=True)
    p = predict_run(slice_cfg, shape)
    rows = 10 * 64 + 1 * 64  # the prefill step: 600 tokens on 10 pages, 20 on 1 (620 tokens >= 512); decodes stage none
    assert p["kv_bytes_staged"].value == rows * (656 + 1152) * slice_cfg.num_hidden_layers
    assert "kv_bytes_staged" not in predict_run(slice_cfg, dataclasses.replace(shape, prefill_staging=False))
    assert "kv_bytes_staged" not in predict_run(slice_cfg, dataclasses.replace(shape, kv_layout="bf16"))
    small = predict_run(slice_cfg, dataclasses.replace(shape, prompt_lens=(300, 20)))
    assert small["kv_bytes_staged"].value == 0  # 320 tokens: under 512
    record = RunRecord("glm-5.3-slice", shape, {"kv_bytes_staged": p["kv_bytes_staged"].value}, {}, {})
    assert run_from_dict(json.loads(json.dumps(record.to_dict()))).shape.prefill_staging is True


def test_staged_rows_is_whole_pages_within_the_size_and_context_bounds():
    from dsaserve.common.causal import staged_rows

    assert staged_rows([600, 20], 620, 64) == 11 * 64
    assert staged_rows([600, 20], 511, 64) == 0  # too few tokens
    assert staged_rows([8000], 512, 64) == 0  # 8000 rows > 8 a token
    assert staged_rows([4096], 512, 64) == 4096  # exactly 8 a token
    assert staged_rows([], 600, 64) == 0 and staged_rows([0], 600, 64) == 0
