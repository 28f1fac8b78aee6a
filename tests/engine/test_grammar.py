"""Structured output in the engine: hostile specs refused before compiling (with the reason), the cache keyed by
spec (key order ignored) holding failures and timeouts too, the bitmask application matching xgrammar's own on
CPU, and random logits forced into schema-valid JSON by the sampler."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest
import torch
import xgrammar as xgr

from dsaserve.common.sampling_params import SamplingParams
from dsaserve.config import load_config
from dsaserve.engine.grammar import (
    MAX_DEPTH,
    MAX_ENUM_VALUES,
    GrammarCompiler,
    GrammarError,
    GrammarSpec,
    load_precompile_file,
    make_spec,
)
from dsaserve.model.sampler import Sampler, apply_token_bitmask
from dsaserve.weights.tokenizer_builder import build_tokenizer

VOCAB = 520  # model vocabulary past the tokenizer's 512: those ids are never allowed


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(load_config("glm-5.3-tiny"))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, [1], timeout_s=20.0)


def deep_schema(n: int) -> dict:
    """A schema nested n objects deep (the hostile-nesting case)."""
    s: dict = {"type": "string"}
    for _ in range(n):
        s = {"type": "object", "properties": {"x": s}, "required": ["x"]}
    return s


@pytest.mark.parametrize("kind,value,reason", [
    ("json_schema", deep_schema(MAX_DEPTH + 5), "nested deeper"),
    ("json_schema", {"enum": list(range(MAX_ENUM_VALUES + 1))}, "enum/const values"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", {"type": "string", "pattern": "(a{1,99999})"}, "exceeds the limit"),
    ("regex", "(a|b){1,5000}", "exceeds the limit"),
    ("regex", "(unclosed", "invalid regular expression"),
    ("regex", "x" * (70 << 10), "characters, more than the limit"),
    ("choice", [], "non-empty list"),
    ("json_yaml", "x", "is not one of"),
])
def test_hostile_or_invalid_specs_are_refused_with_the_reason(kind, value, reason):
    with pytest.raises(GrammarError, match=reason):
        make_spec(kind, value)


def test_a_schema_xgrammar_cannot_compile_fails_with_its_reason_and_the_failure_is_cached(compiler):
    spec = make_spec("json_schema", {"type": "nonsense"})
    misses = compiler.stats["misses"]
    for _ in range(2):
        with pytest.raises(GrammarError, match="nonsense"):
            compiler.compile(spec)
    assert compiler.stats["misses"] == misses + 1  # the second answer came from the cache


def test_the_cache_key_ignores_spacing_and_keeps_property_order(compiler):
    a = make_spec("json_schema", {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}})
    b = make_spec("json_schema", '{"type": "object",   "properties": {"b": {"type": "integer"}, "a": {}}}')
    assert a.value.index('"b"') < a.value.index('"a"')
    assert a == b and compiler.submit(a) is compiler.submit(b)


def test_a_compile_past_the_timeout_fails_and_stays_failed(tok, monkeypatch):
    slow = GrammarCompiler(tok, VOCAB, [1], timeout_s=0.2)
    monkeypatch.setattr(slow, "_compile", lambda spec: time.sleep(1.0))
    spec = make_spec("regex", "[a-z]+")
    with pytest.raises(GrammarError, match="longer than"):
        slow.compile(spec)
    t0 = time.monotonic()
    with pytest.raises(GrammarError, match="longer than"):
        slow.compile(spec)
    assert time.monotonic() - t0 < 0.1 and slow.stats["timeouts"] == 1


def test_bitmask_application_matches_xgrammar_on_cpu(compiler):
    g = compiler.compile(make_spec("json_schema", {"type": "object", "properties": {"n": {"type": "integer"}}}))
    m = xgr.GrammarMatcher(g)
    bitmask = xgr.allocate_token_bitmask(3, VOCAB)
    m.fill_next_token_bitmask(bitmask, 1)
    logits = torch.randn(3, VOCAB)
    ours = apply_token_bitmask(logits, bitmask)
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs))
    assert torch.isinf(ours[1, 512:]).all()  # ids past the tokenizer never pass a grammar


@pytest.mark.parametrize("text, whole", [('{"a": [1, {"b": null}], "c": "d"}', True), ("{}", True),
                                         ("[true]", False), ("[]", False), ('"s"', False), ("1", False)])
def test_json_object_takes_an_object_and_nothing_else(compiler, text, whole):
    """response_format json_object: OpenAI promises an object; any JSON value would let `[true]` through."""
    m = xgr.GrammarMatcher(compiler.compile(make_spec("json_object", None)))
    assert m.accept_string(text) == whole


class _Row:
    prompt_token_ids = [0]
    suppressed_token_ids = ()

    def __init__(self, sampling, grammar):
        self.sampling, self.generator, self.grammar, self.out = sampling, None, grammar, []

    @property
    def output_token_ids(self):
        return self.out


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]}, "v": {"type": "number"}},
     "required": ["kind"], "additionalProperties": False},
    {"anyOf": [{"type": "integer"}, {"type": "null"}]},
]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("schema", SCHEMAS)
def test_random_logits_are_forced_into_schema_valid_json(compiler, tok, schema, temperature):
    spec = make_spec("json_schema", schema)
    compiled = compiler.compile(spec)
    rows = [_Row(SamplingParams(temperature=temperature, seed=i, max_tokens=200),
                 compiler.state(compiled, spec))
            for i in range(4)]
    sampler = Sampler(seed=0)
    gen = torch.Generator().manual_seed(0)  # seeded: an unseeded draw once gave a string whose byte tokens
    for _ in range(200):  # decoded to replacement characters past maxLength (noted, not investigated)
        live = [r for r in rows if not r.grammar.terminated]
        if not live:
            break
        out = sampler.sample(torch.randn(len(live), VOCAB, generator=gen), live)
        for r, t in zip(live, out.token_ids, strict=True):
            r.out.append(t)
    for r in rows:
        assert r.grammar.terminated and r.out[-1] == 1  # the grammar ends with EOS
        jsonschema.validate(json.loads(tok.decode(r.out[:-1])), schema)


def test_a_grammar_waiting_for_the_reasoning_end_leaves_tokens_free_until_then(compiler, tok):
    spec = make_spec("regex", "[0-9]{3}")
    think_end = 7  # any token id: the grammar starts once it is sampled
    row = _Row(SamplingParams(temperature=1.0, seed=0), compiler.state(compiler.compile(spec), spec, think_end))
    sampler = Sampler(seed=0)
    logits = torch.zeros(1, VOCAB)
    logits[0, 100] = 50.0  # a letter-ish token the grammar would refuse
    assert sampler.sample(logits, [row]).token_ids == [100]  # free: still reasoning
    logits[0, think_end] = 100.0
    assert sampler.sample(logits, [row]).token_ids == [think_end]
    logits[0, think_end] = 0.0
    out = sampler.sample(logits, [row]).token_ids[0]
    assert tok.decode([out]).isdigit()  # constrained from here on


def test_a_spec_survives_its_dict_form():
    for spec in (make_spec("choice", ["a", "b"]), make_spec("json_schema", {"type": "integer"}),
                 make_spec("regex", "[0-9]+"), make_spec("json_object", None)):
        assert GrammarSpec.from_dict(spec.to_dict()) == spec


def test_precompile_file_takes_schemas_and_specs(tmp_path):
    p = tmp_path / "schemas.json"
    p.write_text(json.dumps([SCHEMAS[0], {"kind": "regex", "value": "[0-9]+"}]))
    assert load_precompile_file(str(p)) == [make_spec("json_schema", SCHEMAS[0]), GrammarSpec("regex", "[0-9]+")]
    p.write_text(json.dumps([deep_schema(MAX_DEPTH + 1)]))
    with pytest.raises(ValueError, match="--precompile-schemas: entry 0"):
        load_precompile_file(str(p))


def test_the_offline_engine_enforces_a_schema_on_the_real_tiny_model():
    from dsaserve import Engine

    eng = Engine("glm-5.3-tiny", device="cpu", num_pages=32)
    spec = make_spec("json_schema", SCHEMAS[0]).to_dict()
    outs = eng.generate(["Hello", "JSON please"], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=80,
                                                                 structured_outputs=spec))
    for out in outs:
        for sample in out.outputs:
            assert sample.finish_reason == "stop"
            jsonschema.validate(json.loads(sample.text), SCHEMAS[0])
    with pytest.raises(ValueError, match="structured_outputs: json_schema: cannot be compiled"):
        eng.generate(["x"], SamplingParams(structured_outputs=make_spec("json_schema", {"type": "nonsense"})
                                           .to_dict()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bitmask_application_on_the_gpu_equals_the_cpu(compiler):
    g = compiler.compile(make_spec("json_object", None))
    bitmask = xgr.allocate_token_bitmask(4, VOCAB)
    for row in range(4):
        xgr.GrammarMatcher(g).fill_next_token_bitmask(bitmask, row)
    logits = torch.randn(4, VOCAB)
    assert torch.equal(apply_token_bitmask(logits.cuda(), bitmask).cpu(), apply_token_bitmask(logits, bitmask))


def _mask(g, vocab: int = VOCAB) -> torch.Tensor:
    bitmask = torch.zeros((1, -(-vocab // 32)), dtype=torch.int32)
    g.fill(bitmask, 0)
    return bitmask


def test_a_draft_rows_grammar_is_the_state_after_the_drafts_and_leaves_the_request_as_it_was(tok, compiler):
    """speculative decoding (engine/mtp.py): a draft row's mask is the request's grammar after its drafts, taken and
    rolled back; past a draft the grammar refuses, the row is not constrained; a grammar waiting for the reasoning's
    end treats the drafts before it as free text."""
    from dsaserve.engine.grammar import DraftGrammar

    spec = make_spec("regex", "ab(c|d)e")
    ids = {ch: tok.encode(ch, add_special_tokens=False).ids[0] for ch in "abcde"}
    state = compiler.state(compiler.compile(spec), spec)
    before = _mask(state)
    after_ab = DraftGrammar(state, [ids["a"], ids["b"]])
    assert after_ab.active
    m = _mask(after_ab)
    assert torch.equal(_mask(state), before) and not torch.equal(m, before)  # rolled back; another mask
    reference = compiler.state(compiler.compile(spec), spec)
    reference.observe(ids["a"])
    reference.observe(ids["b"])
    assert torch.equal(m, _mask(reference))
    assert not DraftGrammar(state, [ids["a"], ids["e"]]).active and torch.equal(_mask(state), before)
    waiting = compiler.state(compiler.compile(spec), spec, after=ids["e"])  # starts after token "e"
    assert not DraftGrammar(waiting, [ids["c"]]).active  # still waiting: free text
    assert torch.equal(_mask(DraftGrammar(waiting, [ids["c"], ids["e"]])), before)  # started, nothing taken yet
    assert waiting.wait_token == ids["e"]
