"""RequestLimits: one ruler for the HTTP door and the scheduler — each limit names its request field (and
the OpenAI code for the length limits), and the ruler the processor builds from `scheduler_info` is the
scheduler's own."""

from __future__ import annotations

import pytest

from dsaserve.common.request_limits import CONTEXT_LENGTH_EXCEEDED, LimitError, RequestLimits

LIM = RequestLimits(vocab_size=512, max_req_input_len=99, max_seq_len=100, max_running_requests=4)


@pytest.mark.parametrize(("args", "field", "code", "msg"), [
    (([], 1, None, []), "prompt_token_ids", None, "the prompt is empty"),
    (([5, 512], 1, None, []), "prompt_token_ids", None, "token id 512 is outside the vocabulary"),
    (([5, True], 1, None, []), "prompt_token_ids", None, "token id True"),
    (([5], 1, None, [-1]), "stop_token_ids", None, "token id -1"),
    (([5] * 100, 1, None, []), "prompt_token_ids", CONTEXT_LENGTH_EXCEEDED, "100 tokens, more than max_req_input_len"),
    (([5] * 90, 1, 11, []), "max_tokens", CONTEXT_LENGTH_EXCEEDED, "exceeds the context limit of 100"),
    (([5], 5, None, []), "n", None, "5 samples exceed --max-running-requests of 4"),
    (("abc", 1, None, []), "prompt_token_ids", None, "must be a list of token ids"),
    (([5], 1, None, [], [3, 512]), "logit_bias", None, "token id 512 is outside the vocabulary"),
    (([5] * 90, 1, None, [], [], 11), "min_tokens", CONTEXT_LENGTH_EXCEEDED, "11 is more than the 10 tokens"),
])
def test_each_limit_names_its_field_and_code(args, field, code, msg):
    with pytest.raises(LimitError, match=msg) as e:
        LIM.check(*args)
    assert (e.value.field, e.value.code) == (field, code) and str(e.value).startswith(f"{field}: ")


def test_what_fits_passes_and_an_open_max_tokens_gets_the_rest_of_the_context():
    LIM.check([5] * 90, 4, 10, [511])
    assert LIM.check_lengths(90, None, "prompt") == 10


def test_the_ruler_built_from_scheduler_info_is_the_schedulers_own():
    from dsaserve.engine.engine_args import EngineArgs
    from dsaserve.engine.engine_core import EngineCore
    from tests.engine.fake_runner import FakeRunner

    core = EngineCore(EngineArgs.from_kwargs(model="glm-5.3-tiny", max_running_requests=6), runner=FakeRunner())
    limits = core.scheduler.limits
    assert RequestLimits.from_info(core.scheduler_info) == limits
    assert (limits.vocab_size, limits.max_running_requests) == (128, 6) and limits.max_seq_len > 0
