"""`dsaserve eval` on the packaged glm-5.3-mini, cut to a few tokens of a few stdlib files (seconds on the CPU):
its numeric flags are checked before anything loads, and a FAILED setting makes the exit status 1."""

from __future__ import annotations

import pytest

from dsaserve.cli import main
from dsaserve.quality import report
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
