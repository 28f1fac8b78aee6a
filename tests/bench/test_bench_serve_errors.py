"""`dsaserve bench serve`'s common mistakes end in one line naming the flag or URL, not an httpx traceback: no
server on the port, a --base-url without its scheme, a server that wants a key. The key comes from --api-key,
else DSASERVE_API_KEY, as `dsaserve serve` reads it. A stub server stands in for dsaserve's (no model loads),
and the help shows each default once, never `(default: None)`."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dsaserve.cli import main

KEY = "sekrit"
SMALL = ["--num-prompts", "2", "--input-len", "4", "--output-len", "1", "--disable-tqdm"]


class _Stub(BaseHTTPRequestHandler):
    """/v1/models and /v1/completions behind an API key, streaming one token a request."""

    seen: list[str] = []

    def log_message(self, *args) -> None:
        pass

    def _authorized(self) -> bool:
        self.seen.append(self.headers.get("Authorization", ""))
        if self.headers.get("Authorization") == f"Bearer {KEY}":
            return True
        self._send(401, "application/json", json.dumps({"error": {"message": "invalid API key"}}))
        return False

    def _send(self, status: int, kind: str, body: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self) -> None:
        if self.path == "/v1/models" and self._authorized():
            self._send(200, "application/json", json.dumps({"data": [{"id": "stub"}]}))
        elif self.path != "/v1/models":
            self._send(404, "application/json", "{}")

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if not self._authorized():
            return
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1}
        events = [{"choices": [{"index": 0, "text": "a"}], "usage": usage}, {"choices": [], "usage": usage}]
        self._send(200, "text/event-stream", "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n")


@pytest.fixture
def keyed_server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    _Stub.seen = []
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_no_server_on_the_port_is_one_line_naming_the_url(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again below: nothing listens there
    assert main(["bench", "serve", "--base-url", url, *SMALL]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("dsaserve bench serve: ") and f"--base-url {url}" in line and "no server" in line


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost:8000", "ftp://127.0.0.1:8000", "http://"])
def test_a_base_url_without_http_is_a_usage_error(url, capsys):
    assert main(["bench", "serve", "--base-url", url, *SMALL]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--base-url {url!r}" in line and "http://" in line


def test_a_server_that_wants_a_key_says_so(keyed_server, capsys, set_switch):
    set_switch("DSASERVE_API_KEY", None)
    assert main(["bench", "serve", "--base-url", keyed_server, *SMALL]) == 2
    line = _one_line(capsys.readouterr().err)
    assert "401" in line and "--api-key" in line and "DSASERVE_API_KEY" in line and keyed_server in line
    assert main(["bench", "serve", "--base-url", keyed_server, "--api-key", "wrong", *SMALL]) == 2
    assert "refused the key" in _one_line(capsys.readouterr().err)
    assert main(["bench", "serve", "--base-url", f"{keyed_server}/v1", "--api-key", KEY, *SMALL]) == 2
    assert "HTTP 404" in (line := _one_line(capsys.readouterr().err)) and "root (no /v1)" in line


def test_the_key_comes_from_the_flag_else_the_environment(keyed_server, capsys, set_switch):
    set_switch("DSASERVE_API_KEY", KEY)
    assert main(["bench", "serve", "--base-url", keyed_server, *SMALL]) == 0
    assert _Stub.seen and set(_Stub.seen) == {f"Bearer {KEY}"}  # /v1/models and both requests
    set_switch("DSASERVE_API_KEY", "wrong")
    assert main(["bench", "serve", "--base-url", keyed_server, "--api-key", KEY, *SMALL]) == 0  # the flag wins


def test_the_help_shows_each_default_once_and_never_none(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: None)" not in text
    assert text.count("(default: the server's first model)") == 1
    assert "e.g. http://127.0.0.1:8000 --model" in text  # the required --base-url: no default after it
    assert "DSASERVE_API_KEY" in text
