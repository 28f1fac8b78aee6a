"""`dsaserve serve --speculative-algorithm mtp` on the trained built-in model, through the real `openai` client:
greedy completions and chats answer what the offline engine without drafts answers, streamed and whole, and
/metrics and the manifest show the drafts verified and kept (engine/mtp.py)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from dsaserve import Engine, SamplingParams
from tests.server.harness import scrape, value, wait_idle

MINI = "glm-5.3-mini"
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import json\n\ndata = {"]


@pytest.fixture(scope="module")
def spec_server(server_factory):
    return server_factory("--model", MINI, "--speculative-algorithm", "mtp")


def test_completions_equal_the_engine_without_drafts_and_metrics_count_the_drafts(spec_server):
    client = OpenAI(base_url=spec_server.base_url, api_key="unused", timeout=120, max_retries=0)
    plain = Engine(MINI, device="cpu", num_pages=64).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    for prompt, want in zip(PROMPTS, plain, strict=True):
        r = client.completions.create(model=MINI, prompt=prompt, max_tokens=32, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text and r.usage.completion_tokens == 32
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MINI, prompt=prompt, max_tokens=32, temperature=0, stream=True, extra_body={"ignore_eos": True}))
        assert streamed == want.text
    chat = client.chat.completions.create(model=MINI, messages=[{"role": "user", "content": "What is JSON?"}],
                                          max_tokens=24, temperature=0.7, seed=5, logprobs=True, top_logprobs=2)
    assert chat.usage.completion_tokens == len(chat.choices[0].logprobs.content) > 0
    wait_idle(spec_server)
    _, samples = scrape(spec_server)
    drafts = value(samples, "dsaserve_spec_decode_num_draft_tokens_total")
    kept = value(samples, "dsaserve_spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < kept <= drafts
    per_pos = value(samples, "dsaserve_spec_decode_num_accepted_tokens_per_pos_total", position="1")
    assert per_pos == kept and value(samples, "dsaserve_spec_decode_num_drafts_total") == drafts  # one draft a step
    info = spec_server.get("/startup").json()
    assert "speculative_algorithm" in str(info) and "mtp" in str(info)
