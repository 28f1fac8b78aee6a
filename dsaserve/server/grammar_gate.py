"""The scheduler leader's grammar gate: compiles wait off the loop (request path stage 2-3).

Owns: requests whose structured-output grammar is still compiling (parked here while the loop keeps
stepping every other request, then handed to the core once the compile is done — a cache hit there), the
main process's grammar checks (`grammar_check` -> `grammar_result`, so a bad or hostile spec is a 400
before the HTTP response starts), and the timeout: a compile still running after --grammar-compile-timeout
is cached as failed (EngineCore.grammars.fail) and its request / check gets the reason.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from dsaserve.engine.grammar import GrammarError, GrammarSpec


@dataclass
class _Wait:
    key: Any  # rid (a parked request) or qid (a check)
    msg: dict[str, Any] | None
    spec: GrammarSpec | None
    fut: Future | None
    t0: float
    error: str | None = None


class GrammarGate:
    def __init__(self, core: Any) -> None:
        self.core = core
        self.timeout = float(getattr(core.args, "grammar_compile_timeout", 10.0))
        self.parked: dict[str, _Wait] = {}
        self.checks: list[_Wait] = []

    @property
    def busy(self) -> bool:
        return bool(self.parked or self.checks)

    def _start(self, key: Any, msg: dict[str, Any] | None, spec_dict: Any) -> _Wait:
        try:
            spec = GrammarSpec.from_dict(spec_dict if isinstance(spec_dict, dict) else {})
            return _Wait(key, msg, spec, self.core.grammars.submit(spec), time.monotonic())
        except (GrammarError, ValueError) as e:
            return _Wait(key, msg, None, None, time.monotonic(), str(e))

    def park(self, msg: dict[str, Any]) -> bool:
        """True if msg's grammar is not compiled yet: the request waits here (else add it now)."""
        spec = (msg.get("sampling") or {}).get("structured_outputs")
        if spec is None:
            return False
        w = self._start(msg["rid"], msg, spec)
        if w.fut is not None and w.fut.done():
            return False  # compiled (or failed) already: add_request reports either at once
        self.parked[msg["rid"]] = w
        return True

    def check(self, qid: Any, spec: Any) -> None:
        self.checks.append(self._start(qid, None, spec))

    def drop(self, rid: str) -> bool:
        return self.parked.pop(rid, None) is not None

    def _settle(self, w: _Wait) -> bool:
        """Done (with w.error set on failure)?"""
        if w.error is not None:
            return True
        if not w.fut.done():
            if time.monotonic() - w.t0 < self.timeout:
                return False
            self.core.grammars.fail(w.spec, f"compiling took longer than {self.timeout:g} s")
            w.error = f"{w.spec.kind}: compiling took longer than {self.timeout:g} s"
            return True
        exc = w.fut.exception()
        w.error = None if exc is None else str(exc)
        return True

    def ready_requests(self) -> list[dict[str, Any]]:
        """Parked GENERATE messages whose compile finished (add them: the core reports a failure)."""
        done = [rid for rid, w in self.parked.items() if self._settle(w)]
        return [self.parked.pop(rid).msg for rid in done]

    def check_results(self) -> list[tuple[Any, str | None]]:
        out, keep = [], []
        for w in self.checks:
            (out if self._settle(w) else keep).append(w)
        self.checks = keep
        return [(w.key, w.error) for w in out]
