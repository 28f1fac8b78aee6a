"""`dsaserve serve` refuses a --port it cannot listen on, or a --host that does not resolve, in one line and with
exit status 2, before any child process starts (uvicorn found out only after the model had loaded)."""

from __future__ import annotations

import socket

from dsaserve.cli import main


def test_a_port_in_use_is_one_line_naming_the_port(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dsaserve serve: error: --port: cannot listen on 127.0.0.1:{port} (Address already in use)"]


def test_a_host_that_does_not_resolve_names_the_host(capsys):
    assert main(["serve", "--host", "no-such-host.invalid", "--port", "8000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dsaserve serve: error: --host: 'no-such-host.invalid' does not resolve")
