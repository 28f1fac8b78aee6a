"""`dsaserve serve` flags: the help shows a default only where it says something (issue 20), and the API
key also comes from DSASERVE_API_KEY, as vLLM's from VLLM_API_KEY (issue 20.8b)."""

from __future__ import annotations

import argparse
import re

import pytest

from dsaserve.cli import serve
from dsaserve.engine.engine_args import EngineArgs
from dsaserve.server.server_args import API_KEY_ENV, HelpFormatter, ServerArgs


def serve_parser() -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser(prog="dsaserve").add_subparsers()
    serve.register(sub)
    return sub.choices["serve"]


def flag_help(text: str) -> dict[str, str]:
    """--flag -> its help text (wrapped lines joined)."""
    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (--[\w-]+)", line)
        if m:
            current = m.group(1)
            out[current] = line
        elif current and line.startswith("    "):
            out[current] += " " + line.strip()
        else:
            current = None
    return {k: " ".join(v.split()) for k, v in out.items()}


def test_help_shows_each_default_once_and_never_none():
    text = serve_parser().format_help()
    helps = flag_help(text)
    assert "(default: None)" not in text
    assert "(default: 8000)" in helps["--port"]
    assert "(default: 30.0)" in helps["--drain-timeout"]
    assert "(default: wait)" in helps["--startup-timeout"]
    assert "(default: --model)" in helps["--served-model-name"]
    assert API_KEY_ENV in helps["--api-key"]
    for name, h in helps.items():
        assert h.count("(default:") <= 1, (name, h)


def test_a_required_flag_shows_no_default():
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--base-url", required=True, help="server root")
    p.add_argument("--n", type=int, default=3, help="how many")
    text = p.format_help()
    assert "(default: None)" not in text and "(default: 3)" in text


def parse(*argv: str) -> ServerArgs:
    ns = serve_parser().parse_args(list(argv))
    return ServerArgs.from_cli_args(ns, EngineArgs.from_cli_args(ns), "/ckpt")


@pytest.mark.parametrize("env,argv,expected", [
    (None, (), None), ("env-key", (), "env-key"), ("env-key", ("--api-key", "flag-key"), "flag-key"),
    ("", (), None),
])
def test_the_api_key_comes_from_the_flag_else_the_environment(set_switch, env, argv, expected):
    set_switch(API_KEY_ENV, env)
    assert parse(*argv).api_key == expected


def test_drain_timeout_stays_a_float():
    assert parse("--drain-timeout", "0.9").drain_timeout_s == 0.9
