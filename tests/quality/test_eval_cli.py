"""`dsaserve eval` on the packaged glm-5.3-mini, cut to a few tokens of a few stdlib files (seconds on the CPU):
its numeric flags are checked before anything loads, a FAILED setting makes the exit status 1, and a held-out
split that is not the one the model was trained on is said so on the console (its perplexity is another
text's)."""

from __future__ import annotations

import json

import pytest

from dsaserve.cli import main
from dsaserve.quality import report
from dsaserve.quality.report import EvalArgs, heldout_data
from dsaserve.weights.checkpoint_cache import packaged_checkpoint

CKPT = packaged_checkpoint("glm-5.3-mini")
pytestmark = pytest.mark.skipif(CKPT is None, reason="dsaserve/builtin/glm-5.3-mini is not in this checkout")
SMALL = {"--max-files": "60", "--windows": "1", "--window-len": "32", "--prompts": "1", "--prompt-len": "8",
         "--max-tokens": "2", "--batch": "1"}


def _eval(*args: str, model: str = "glm-5.3-mini", **flags: str) -> int:
    argv = ["eval", "--model", model, "--device", "cpu", "--groups", "sparse"]
    for flag, value in (SMALL | {f"--{k.replace('_', '-')}": v for k, v in flags.items()}).items():
        argv += [flag, value]
    return main([*argv, *args])


@pytest.mark.parametrize("flag, value", [
    ("window_len", "0"), ("window_len", "-5"), ("windows", "0"), ("windows", "-1"), ("batch", "0"),
    ("prompts", "0"), ("prompt_len", "0"), ("max_tokens", "0"), ("max_files", "0"), ("windows", "two"),
])
def test_a_numeric_flag_below_one_is_a_usage_error_naming_it(flag, value, capsys, monkeypatch):
    def no_run(*a, **k):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(report, "run_setting", no_run)
    with pytest.raises(SystemExit) as e:
        _eval(**{flag: value})
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --{flag.replace('_', '-')}:" in err and "positive integer" in err, err


def test_a_prompt_longer_than_the_windows_is_a_usage_error(capsys, monkeypatch):
    """Prompts are cut from the held-out windows: a longer --prompt-len was cut to --window-len silently."""
    monkeypatch.setattr(report, "run_setting", lambda *a, **k: pytest.fail("nothing may run"))
    assert _eval(prompt_len="64", window_len="32") == 2
    assert "--prompt-len: 64 is longer than --window-len 32" in capsys.readouterr().err


def test_a_failed_setting_makes_the_exit_status_1(capsys, monkeypatch):
    real = report.run_setting

    def dense_breaks(model, s, *a):
        if s.variant == "dense":
            raise RuntimeError("broken on purpose")
        return real(model, s, *a)

    monkeypatch.setattr(report, "run_setting", dense_breaks)
    assert _eval() == 1
    captured = capsys.readouterr()
    assert "cpu:fp8_ds_mla:dense: FAILED RuntimeError: broken on purpose" in captured.out
    assert "1 of 2 settings FAILED: cpu:fp8_ds_mla:dense" in captured.err
    monkeypatch.setattr(report, "run_setting", real)
    assert _eval() == 0


def _checkpoint_with_recipe(tmp_path, **recipe):
    """The packaged model's files, with this corpus_recipe.json instead of its own."""
    out = tmp_path / "ckpt"
    out.mkdir()
    for f in CKPT.iterdir():
        if f.name != "corpus_recipe.json":
            (out / f.name).symlink_to(f)
    (out / "corpus_recipe.json").write_text(json.dumps(json.loads((CKPT / "corpus_recipe.json").read_text()) | recipe))
    return out


def _here() -> dict:
    _, _, info = heldout_data(EvalArgs(model=str(CKPT), max_files=60, windows=1, window_len=32, prompts=1))
    return info


def test_a_heldout_split_unlike_the_trained_one_is_warned_about(tmp_path, capsys):
    here = _here()
    other = _checkpoint_with_recipe(tmp_path, python_version="3.0.1", heldout_files=here["heldout_files"] + 3,
                                    heldout_tokens=here["heldout_tokens"] + 1000, max_files=60)
    _, _, info = heldout_data(EvalArgs(model=str(other), windows=1, window_len=32, prompts=1))
    assert info["trained_on_heldout_files"] == here["heldout_files"] + 3
    assert info["trained_on_heldout_tokens"] == here["heldout_tokens"] + 1000
    warning = info["split_warning"]
    assert f"(Python {here['python']}: {here['heldout_files']} held-out files, {here['heldout_tokens']} tokens)" \
        in warning
    assert f"(Python 3.0.1: {here['heldout_files'] + 3} held-out files, {here['heldout_tokens'] + 1000} tokens)" \
        in warning
    path = tmp_path / "eval.json"
    assert _eval("--json", str(path), model=str(other)) == 0
    said = json.loads(path.read_text())["data"]["split_warning"]
    assert said.startswith(warning.split(";")[0]) and "the first 60 files of" in said  # --max-files 60
    assert f"WARNING: {said}" in capsys.readouterr().err


def test_the_trained_split_rebuilt_as_it_was_gets_no_warning(tmp_path, capsys):
    here = _here()
    same = _checkpoint_with_recipe(tmp_path, python_version=here["python"], heldout_files=here["heldout_files"],
                                   heldout_tokens=here["heldout_tokens"], max_files=60)
    _, _, info = heldout_data(EvalArgs(model=str(same), windows=1, window_len=32, prompts=1))
    assert info["split_warning"] is None
    assert _eval(model=str(same)) == 0
    assert "WARNING" not in capsys.readouterr().err
