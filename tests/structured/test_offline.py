"""Structured outputs through the offline API: every output obeys its constraint (greedy and
seeded sampling, n > 1, batches mixing constrained and free requests, preemption), bad specs are
ValueErrors naming the problem, and free requests are untouched by constrained neighbours."""
from __future__ import annotations

import json
import re

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from tests.structured.cases import (CHOICES, CODE_REGEX, MAX_TOKENS, PERSON, check_choice, check_code,
                                    check_person, json_prefix_ok)
from vgraph import LLM, SamplingParams
from vgraph.structured import GuidedDecodingParams, StructuredOutputsParams as S
from vgraph.structured.bitmask import apply_masks, fill_masks, unpack
from vgraph.structured.matcher import GrammarState

PROMPTS = ["Hello", "The sea was calm", "Numbers like", "Good morning, good"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=256,
               max_model_len=256, max_logprobs=5, enforce_eager=True)


def _gen(llm: LLM, prompts: list[str], params) -> list:
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate_for_every_sequence(llm, temperature):
    params = SamplingParams(temperature=temperature, seed=7, n=3, max_tokens=MAX_TOKENS,
                            structured_outputs=S(json=PERSON))
    outs = _gen(llm, PROMPTS, params)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 12
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop", c
            check_person(c.text)
    if temperature > 0:
        assert len(set(texts)) > 1, "sampled sequences should differ"


def test_regex_choice_and_grammar(llm):
    grammar = 'start: "(" num ("," num)? ")"\nnum: /[0-9]{1,3}/'
    specs = [S(regex=CODE_REGEX), S(choice=CHOICES), S(grammar=grammar)]
    for temperature in (0.0, 0.9):
        params = [SamplingParams(temperature=temperature, seed=3, n=2, max_tokens=32, structured_outputs=s)
                  for s in specs]
        code, choice, gram = _gen(llm, PROMPTS[:3], params)
        for c in code.outputs:
            check_code(c.text)
        for c in choice.outputs:
            check_choice(c.text)
        for c in gram.outputs:
            assert re.fullmatch(r"\(\d{1,3}(,\d{1,3})?\)", c.text), c.text
        assert all(c.finish_reason == "stop" for o in (code, choice, gram) for c in o.outputs)


def test_free_requests_are_unchanged_by_constrained_neighbours(llm):
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True)]
    alone = _gen(llm, PROMPTS[:2], free)
    constrained = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=S(json=PERSON)),
                   SamplingParams(temperature=0.7, seed=5, max_tokens=32, structured_outputs=S(regex=CODE_REGEX))]
    mixed = _gen(llm, [PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]],
                 [constrained[0], free[0], constrained[1], free[1]])
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[3].outputs[0].token_ids == alone[1].outputs[0].token_ids
    check_person(mixed[0].outputs[0].text)
    check_code(mixed[2].outputs[0].text)


def test_guided_decoding_alias_and_dict_form(llm):
    by_alias = SamplingParams(temperature=0.0, max_tokens=16, guided_decoding=GuidedDecodingParams(choice=CHOICES))
    by_dict = SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"choice": CHOICES})
    a, b = _gen(llm, ["Hello", "Hello"], [by_alias, by_dict])
    assert a.outputs[0].text == b.outputs[0].text
    check_choice(a.outputs[0].text)
    assert by_alias.structured_outputs == by_dict.structured_outputs and by_alias.guided_decoding is None


@pytest.mark.parametrize("spec, message", [
    (dict(regex="[a-"), "invalid structured output regex"),
    (dict(json={"type": "no-such-type"}), "invalid structured output json"),
    (dict(grammar="start: undefined_rule"), "invalid structured output grammar"),
])
def test_invalid_specs_are_value_errors_at_add_request_and_harm_nothing(llm, spec, message):
    with pytest.raises(ValueError, match=message):
        _gen(llm, ["Hello"], SamplingParams(max_tokens=8, structured_outputs=S(**spec)))
    assert not llm.engine.has_unfinished_requests()
    out = _gen(llm, ["Hello"], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=S(choice=CHOICES)))
    check_choice(out[0].outputs[0].text)


@pytest.mark.parametrize("fields, message", [
    (dict(), "exactly one of"),
    (dict(regex="a", choice=["a"]), "exactly one of.*regex, choice"),
    (dict(json="{not json"), "not valid JSON"),
    (dict(json=[1, 2]), "must be a JSON schema"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice=["a", ""]), "non-empty list of non-empty strings"),
    (dict(json_object=False), "exactly one of"),
])
def test_params_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        S(**fields)


def test_sampling_params_checks():
    with pytest.raises(ValueError, match="same setting"):
        SamplingParams(structured_outputs=S(regex="a"), guided_decoding=S(regex="b"))
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs=S(regex="a+"))
    with pytest.raises(ValueError, match="unknown fields: jsonn"):
        SamplingParams(structured_outputs={"jsonn": {}})


def test_grammars_compile_once_per_distinct_spec(llm):
    compiler = llm.engine.grammar_compiler
    hits, misses = compiler.hits, compiler.misses
    spec = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}
    params = SamplingParams(temperature=0.0, max_tokens=16, n=2, structured_outputs=S(json=spec))
    _gen(llm, ["Hello", "Rain fell"], params)
    # Same schema as a string with another key order: the same grammar.
    again = SamplingParams(max_tokens=16, structured_outputs=S(json='{"required":["k"],"type":"object",'
                                                                        '"properties":{"k":{"enum":["x","y"]}}}'))
    _gen(llm, ["Hello"], again)
    assert compiler.misses == misses + 1
    assert compiler.hits == hits + 2


def test_grammar_end_stops_the_request_even_with_ignore_eos(llm):
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, structured_outputs=S(regex=CODE_REGEX))
    out = _gen(llm, ["Hello"], params)[0].outputs[0]
    check_code(out.text)
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.engine.eos_token_ids


def test_logprobs_are_the_raw_model_logprobs(llm):
    """A forced token's logprob is the model's; the top-n include tokens the grammar bans."""
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, structured_outputs=S(choice=["yes"]))
    out = _gen(llm, ["Hello"], params)[0].outputs[0]
    assert out.text == "yes"
    tok = llm.get_tokenizer()
    first = out.logprobs[0]
    banned = [t for t in first if t != out.token_ids[0]]
    assert banned and max(first[t] for t in banned) > first[out.token_ids[0]] - 50
    assert any(not "yes".startswith(tok.decode([t])) for t in banned)
    free = _gen(llm, ["Hello"], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0].outputs[0]
    top = {t: v for t, v in free.logprobs[0].items()}
    for t, v in first.items():
        if t in top:
            assert v == pytest.approx(top[t], abs=1e-5)


def test_preemption_does_not_advance_a_matcher_twice():
    llm = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=24, block_size=16,
              max_model_len=256, enforce_eager=True, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(6, 500, (k,), generator=g).tolist()}
               for k in (30, 34, 38, 42, 46, 50)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=S(json=PERSON))
    outs = _gen(llm, prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    roomy = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=256,
                max_model_len=256, enforce_eager=True, enable_prefix_caching=False)
    for out, ref in zip(outs, _gen(roomy, prompts, params)):
        check_person(out.outputs[0].text)
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_json_object_mode_is_honest_on_a_random_model(llm):
    """Any JSON object is allowed, so a random model's strings rarely close: each output that
    stops parses as an object, and each that hits max_tokens is a prefix of a JSON document."""
    params = SamplingParams(temperature=0.8, seed=1, n=4, max_tokens=48, structured_outputs=S(json_object=True))
    outs = _gen(llm, PROMPTS, params)
    for c in (c for o in outs for c in o.outputs):
        assert c.text.startswith("{")
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict)
        else:
            assert c.finish_reason == "length" and json_prefix_ok(c.text), c.text


def test_masks_cover_the_models_vocab_beyond_the_tokenizer(llm):
    """The model may have more logit rows than tokenizer ids: those are never allowed."""
    engine = llm.engine
    grammar = engine.grammar_compiler.compile(S(json=PERSON))
    state = GrammarState(grammar.matcher(), engine.eos_token_ids)
    masks = fill_masks([None, state], engine.vocab_size)
    assert masks is not None and masks.rows == [1]
    allowed = unpack(masks.bitmask, engine.vocab_size)[0]
    tok = llm.get_tokenizer()
    assert allowed.sum() >= 1 and all(tok.decode([t]).startswith("{") for t in allowed.nonzero().flatten().tolist())
    logits = torch.randn(2, engine.vocab_size)
    out = apply_masks(logits, torch.tensor(masks.rows), masks.bitmask)
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1][~allowed]).all() and torch.equal(out[1][allowed], logits[1][allowed])


def test_unpack_matches_bit_order():
    bitmask = torch.tensor([[0b1011 - 2**31, 0b101]], dtype=torch.int32)  # bit 31 is the sign bit
    allowed = unpack(bitmask, 34)[0]
    assert allowed.nonzero().flatten().tolist() == [0, 1, 3, 31, 32]


def test_a_model_with_more_logit_rows_than_tokens(tmp_path):
    """lm_head rows beyond the tokenizer (padded vocabularies, as Qwen's): never generated."""
    from vgraph.models.demo import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "padded", "llama", seed=0, vocab_size=600)
    llm = LLM(path, dtype="float32", device="cpu", num_gpu_blocks=64, max_model_len=256, enforce_eager=True)
    assert llm.engine.vocab_size == 600 and len(llm.get_tokenizer()) == 512
    params = SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=MAX_TOKENS, structured_outputs=S(json=PERSON))
    for c in _gen(llm, ["Hello"], params)[0].outputs:
        assert max(c.token_ids) < 512
        check_person(c.text)
    state = GrammarState(llm.engine.grammar_compiler.compile(S(json_object=True)).matcher(), llm.engine.eos_token_ids)
    allowed = unpack(fill_masks([state], 600).bitmask, 600)[0]
    assert not allowed[512:].any()


def test_missing_llguidance_is_a_clear_error(monkeypatch):
    import sys

    from vgraph.structured.compiler import GrammarCompiler

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    compiler = GrammarCompiler(None, 512, [1])
    with pytest.raises(ValueError, match="pip install llguidance"):
        compiler.compile(S(regex="a+"))
