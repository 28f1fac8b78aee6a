"""`dsaserve generate` drives the offline Engine (real glm-5.3-tiny on the CPU)."""

from __future__ import annotations

import json
import math

import pytest

from dsaserve import Engine, SamplingParams
from dsaserve.cli import main


def test_generate_json_prints_the_engines_greedy_tokens_and_text(tiny_checkpoint, capsys):
    tiny_checkpoint("glm-5.3-tiny")
    rc = main(["generate", "--model", "glm-5.3-tiny", "--prompt-ids", "5,6,7,8", "--max-tokens", "6", "--ignore-eos",
               "--json",
               "--device", "cpu", "--kv-layout", "bf16", "--num-pages", "4"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    expect = Engine("glm-5.3-tiny", device="cpu", kv_layout="bf16", num_pages=4).generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert out["token_ids"] == expect.token_ids and out["text"] == expect.text
    assert out["prompt_token_ids"] == [5, 6, 7, 8] and out["finish_reason"] == "length"
    assert "load_weights" in out["startup_time"]


def test_generate_rejects_bad_prompt_ids_and_flags_by_name(capsys):
    assert main(["generate", "--prompt-ids", "1,x"]) == 2
    assert "--prompt-ids" in capsys.readouterr().err
    assert main(["generate", "--prompt-ids", "1", "--max-num-batched-tokens", "0"]) == 2
    assert "--max-num-batched-tokens" in capsys.readouterr().err


def test_random_weights_of_the_packaged_model_keep_its_tokenizer(capsys):
    """--load-format dummy on glm-5.3-mini said the model had no tokenizer: its prompt text now tokenizes."""
    rc = main(["generate", "--model", "glm-5.3-mini", "--load-format", "dummy", "--prompt", "def f(", "--json",
               "--max-tokens", "2", "--device", "cpu", "--num-pages", "4"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    from tokenizers import Tokenizer

    from dsaserve.weights.checkpoint_cache import packaged_checkpoint

    tok = Tokenizer.from_file(str(packaged_checkpoint("glm-5.3-mini") / "tokenizer.json"))
    assert out["prompt_token_ids"] == tok.encode("def f(").ids and len(out["token_ids"]) == 2


def test_a_kv_budget_below_one_page_is_refused_before_the_weights_load(capsys, monkeypatch):
    from dsaserve.engine import model_runner

    monkeypatch.setattr(model_runner.ModelRunner, "_build_and_load", lambda *a: pytest.fail("the weights loaded"))
    assert main(["generate", "--prompt-ids", "1,2", "--kv-cache-bytes", "100", "--device", "cpu"]) == 2
    assert "--kv-cache-bytes: 100 bytes is less than one 64-token page" in capsys.readouterr().err


def test_generate_scores_the_prompt_with_prompt_logprobs(capsys):
    """--prompt-logprobs: the JSON's entries are the engine's; the text output adds the prompt's perplexity."""
    argv = ["generate", "--prompt-ids", "5,6,7,8,9", "--max-tokens", "1", "--prompt-logprobs", "2", "--device", "cpu",
            "--num-pages", "4"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plp = out["prompt_logprobs"]
    assert len(plp) == 5 and plp[0] is None and all(len(e["top"]) == 2 and e["rank"] >= 1 for e in plp[1:])
    assert main(argv) == 0
    mean = sum(e["logprob"] for e in plp[1:]) / 4
    assert f"[prompt: 4 tokens scored, logprob {4 * mean:.3f}, perplexity {math.exp(-mean):.3f}]" in \
        capsys.readouterr().err
