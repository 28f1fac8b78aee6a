"""A micro training run end to end on the CPU: the loss falls, the export is a real dsaserve checkpoint,
the engine's logits (main and MTP) equal HF's on the exported weights, and `dsaserve eval` runs on it.

The run uses glm-5.3-tiny's structure (index_topk 8 under a 64-token context: the sparse path selects) so
it takes seconds; glm-5.3-mini differs only in sizes, and the mapping under test is the same code.
"""

from __future__ import annotations

import json

import pytest
import torch

from dsaserve.config import load_config
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.model.forward_batch import contiguous_batch
from dsaserve.training.export import load_mini
from dsaserve.training.hf_model import causal_mask
from dsaserve.training.trainer import TrainArgs, train
from dsaserve.weights.spec import checkpoint_specs

ARGS = dict(config="glm-5.3-tiny", steps=16, seq_len=64, batch_size=4, lr=3e-3, warmup_steps=2, max_files=30,
            heldout_permille=300, eval_windows=2, eval_every=8, log_every=4, dense_frac=0.25)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("mini") / "ckpt"
    torch.manual_seed(0)
    summary = train(TrainArgs(out=str(out), **ARGS), log=lambda s: None)
    return out, summary


def test_loss_falls_and_reports_are_written(trained):
    out, summary = trained
    curve = json.loads((out / "loss_curve.json").read_text())
    train_losses = [c["train_loss"] for c in curve if "train_loss" in c]
    held = [c["heldout"]["loss"] for c in curve if "heldout" in c]
    assert train_losses[-1] < train_losses[0] - 0.5, train_losses
    assert held[-1] < held[0], held
    assert summary["steps"] == ARGS["steps"]
    assert summary["heldout_sparse"]["loss"] < summary["baselines"]["uniform"]
    # FP8 block-scaled export costs little on the same windows
    assert abs(summary["heldout_fp8_export"]["loss"] - summary["heldout_sparse"]["loss"]) < 0.05
    recipe = json.loads((out / "corpus_recipe.json").read_text())
    assert recipe["files"] == recipe["train_files"] + recipe["heldout_files"] > 0
    assert recipe["heldout_permille"] == ARGS["heldout_permille"]


def test_export_is_the_spec_and_loads(trained):
    out, _ = trained
    cfg = load_config(out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index) == {s.name for s in checkpoint_specs(cfg)}
    runner = ModelRunner.from_kwargs(str(out), kv_layout="fp32", load_mtp=True, device="cpu")
    assert runner.load_report.tensors_loaded == len(index)
    assert runner.tokenizer.token_to_id("<|endoftext|>") == 1 == cfg.eos_token_id[0]


def _prompt(out, n: int) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = tok.encode("def chunk(self, size):\n    return self.read(size)\n" * 8).ids
    assert len(ids) >= n
    return ids[:n]


def test_engine_matches_hf_on_exported_weights(trained):
    from dsaserve.quality.hf_oracle import hf_model

    out, _ = trained
    cfg = load_config(out)
    prompt = _prompt(out, 5 * cfg.index_topk)  # longer than top-k: shared layers reuse a real selection
    runner = ModelRunner.from_kwargs(str(out), kv_layout="fp32", load_mtp=True, device="cpu")
    batch = contiguous_batch([prompt], [0], [0])
    batch.logits_indices = torch.arange(len(prompt))
    ours, hidden = runner.model(batch, runner.kv_pool)
    with torch.no_grad():
        ref = hf_model(str(out))(torch.tensor([prompt])).logits[0]
    assert torch.allclose(ours, ref, atol=2e-3, rtol=0), float((ours - ref).abs().max())
    # MTP: the trainer's module (loaded back from the export) against the engine's forward_mtp
    mini = load_mini(out)
    x = torch.tensor([prompt])
    with torch.no_grad():
        h = mini.lm.model(input_ids=x, use_cache=False).last_hidden_state
        s = len(prompt)
        pos = torch.arange(s - 1)[None]
        mh = mini.mtp.forward_mtp(mini.lm.model.embed_tokens(x[:, 1:]), h[:, :-1],
                                  mini.lm.model.rotary_emb(h, pos), causal_mask(s - 1, x.device), pos)
        mref = mini.lm.lm_head(mh)[0]
    mb = contiguous_batch([prompt[1:]], [0], [0])
    mb.logits_indices = torch.arange(s - 1)
    mtp = runner.model.forward_mtp(mb, runner.kv_pool, hidden[:-1])
    assert torch.allclose(mtp, mref, atol=2e-3, rtol=0), float((mtp - mref).abs().max())


def test_eval_cli_on_the_trained_model(trained, tmp_path, capsys):
    from dsaserve.cli import main

    out, _ = trained
    path = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(out), "--device", "cpu", "--windows", "2", "--window-len", "64", "--batch", "2",
               "--prompts", "3", "--prompt-len", "40", "--max-tokens", "6", "--json", str(path)])
    assert rc == 0
    res = json.loads(path.read_text())
    assert not res["errors"]
    names = set(res["results"])
    assert {"cpu:fp32", "cpu:bf16", "cpu:fp8_ds_mla", "cpu:fp8_e4m3", "cpu:fp8_ds_mla:dense",
            "cpu:fp8_ds_mla:all_full"} <= names
    for name, r in res["results"].items():
        assert r["tokens"] == 2 * 63 and len(r["greedy"]) == 3 and all(len(g) == 6 for g in r["greedy"])
        assert name.startswith("hf:") or 0 <= r["mtp_accept"] <= 1  # HF has no MTP layer
    rows = {c["question"]: c for c in res["comparisons"]}
    # kv 3, sparse, indexer, CPU bfloat16 vs float32 compute, and each of the 4 layouts against HF through its codec
    assert len(rows) == 10 and res["results"]["cpu:fp8_ds_mla:bfloat16"]["describe"].startswith("cpu bfloat16")
    for row in rows.values():  # each parting: where, and both runs' top-1 margins there (nats, >= 0)
        assert len(row["partings"]) == row["of"] - row["identical"]
        assert all(0 <= p["step"] < 6 and min(p["margin"], p["ref_margin"]) >= 0 for p in row["partings"])
    # bf16 KV against fp32 KV on a trained model: a small perplexity change, not a different model
    assert abs(rows["KV bf16 vs fp32"]["ppl_change_pct"]) < 2
    # against HF with the same codec every layout is HF's model: perplexity to float32 noise
    assert all(abs(rows[f"KV {x} vs HF, same codec"]["ppl_change_pct"]) < 0.05
               for x in ("fp32", "bf16", "fp8_ds_mla", "fp8_e4m3")), rows
    assert "greedy identical" in capsys.readouterr().out
