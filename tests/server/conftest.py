"""Server test fixtures: servers started on demand (stopped at the end of the session), the tokenizer."""

from __future__ import annotations

import pytest

from tests.server.harness import MODEL, ServerProcess


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory, tiny_checkpoint):
    tiny_checkpoint(MODEL)  # build the cached checkpoint once, before several servers race for it
    started: list[ServerProcess] = []

    def make(*extra: str, env: dict[str, str] | None = None, wait: bool = True) -> ServerProcess:
        s = ServerProcess(tmp_path_factory.mktemp("server"), *extra, env=env)
        started.append(s)
        if wait:
            s.wait_up()
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server(server_factory) -> ServerProcess:
    """The shared server most tests talk to (default engine settings)."""
    return server_factory()


@pytest.fixture(scope="session")
def tokenizer(tiny_checkpoint):
    from dsaserve.server.hf_tokenizer import HFTokenizer

    return HFTokenizer(tiny_checkpoint(MODEL))
