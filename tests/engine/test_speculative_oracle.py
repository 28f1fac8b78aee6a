"""Speculative decoding with drafts that are always right (each request's drafts replaced by plain decoding's own
next tokens, engine/mtp.py's `extend` wrapped): every draft is kept up to the request's end, so a verify step's
last kept token may be where a grammar completes or a stop token ends the request — the outputs, finish reasons
included, are still plain decoding's."""

from __future__ import annotations

import pytest

from dsaserve import Engine, SamplingParams
from dsaserve.engine.grammar import make_spec
from dsaserve.engine.mtp import MTPDrafter

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}}, "required": ["a"]}
SPECS = [make_spec("json_schema", SCHEMA), make_spec("regex", "(def|class) [a-z_]{2,5}\\(\\):"), None]
TEXTS = ["The quick brown fox", "def fibonacci(n):"]


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_drafts_that_are_always_right_end_requests_as_plain_decoding(monkeypatch, ignore_eos):
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=ignore_eos,
                             structured_outputs=s.to_dict() if s else None) for s in SPECS]
    plain = Engine("glm-5.3-mini", device="cpu", num_pages=64)
    base = {(t, i): plain.generate([t], p)[0] for t in TEXTS for i, p in enumerate(params)}
    truth = {(tuple(o.prompt_token_ids), i): list(o.prompt_token_ids) + list(o.token_ids) for (_, i), o in base.items()}
    extend = MTPDrafter.extend

    def right(self, sched, *args, **kw):
        extend(self, sched, *args, **kw)
        for req in sched.reqs:
            seq = truth[tuple(req.prompt_token_ids), params.index(req.sampling)]
            if req.drafts:  # past the plain run's end any token will do: it ended there
                req.drafts = (seq[len(req.tokens):len(req.tokens) + len(req.drafts)] + [0] * 8)[:len(req.drafts)]

    monkeypatch.setattr(MTPDrafter, "extend", right)
    eng = Engine("glm-5.3-mini", device="cpu", num_pages=64, speculative_algorithm="mtp", speculative_num_steps=3)
    for (t, i), b in base.items():
        s = eng.generate([t], params[i])[0]
        assert (s.token_ids, s.finish_reason) == (b.token_ids, b.finish_reason), (t, SPECS[i])
    stats = eng.core.stats()
    assert stats["spec_accepted_tokens"] >= 0.8 * stats["spec_draft_tokens"] > 0
    eng.core.check_no_leak()
