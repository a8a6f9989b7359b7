"""Engine behaviour beyond greedy equality: bad input, aborts, n > 1, stop strings, seeds."""
from __future__ import annotations

import pytest
import torch

from tests.checkpoints import tiny_checkpoint
from vgraph import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=128,
               max_model_len=256, max_logprobs=5, enforce_eager=True)


def _all_free(llm: LLM) -> bool:
    return llm.engine.scheduler.kv_manager.pool.num_free_blocks == llm.engine.runner.num_blocks


BAD_INPUTS = [
    (list(range(3, 300)), {}, "maximum context length is"),
    (list(range(3, 200)), {"max_tokens": 100}, r"you requested 297 tokens \(197 in the prompt, 100 in the completion\)"),
    ("", {}, "empty"),
    ([], {}, "empty"),
    ([5, 100000], {}, "outside the vocabulary"),
    ([5, -1], {}, "outside the vocabulary"),
    ("hi", {"temperature": -1.0}, "temperature"),
    ("hi", {"top_p": 0.0}, "top_p"),
    ("hi", {"top_p": 1.5}, "top_p"),
    ("hi", {"top_k": -2}, "top_k"),
    ("hi", {"presence_penalty": 3.0}, "presence_penalty"),
    ("hi", {"frequency_penalty": -2.5}, "frequency_penalty"),
    ("hi", {"repetition_penalty": 0.0}, "repetition_penalty"),
    ("hi", {"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ("hi", {"stop": [""]}, "stop strings"),
    ("hi", {"logprobs": 6}, "maximum of 5"),
]


@pytest.mark.parametrize("prompt,fields,message", BAD_INPUTS)
def test_bad_input_is_a_clear_value_error_and_harms_nothing(llm, prompt, fields, message):
    good = {"prompt_token_ids": [5, 6, 7]}
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=message):
        llm.generate([good, prompt], [greedy, _params(fields)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and _all_free(llm)
    # the engine still serves the good request afterwards
    assert len(llm.generate(good, greedy, use_tqdm=False)[0].outputs[0].token_ids) == 4


def _params(fields: dict) -> SamplingParams:
    """SamplingParams validates at construction; build a valid one and corrupt it after, so the
    engine's own validation is what is tested."""
    params = SamplingParams(temperature=0, max_tokens=fields.get("max_tokens", 4))
    for k, v in fields.items():
        setattr(params, k, v)
    return params


def test_sampling_params_reject_bad_values_at_construction():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=3, max_tokens=2)


def test_abort_mid_flight_frees_every_block(llm):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    for i in range(4):
        llm.add_request(f"a{i}", list(range(10, 10 + 20 * (i + 1))), params)
    for _ in range(3):
        llm.step()
    llm.abort_request(["a0", "a2"])
    finished = {}
    while llm.has_unfinished_requests():
        for out in llm.step().outputs:
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"a1", "a3"}
    assert all(len(o.outputs[0].token_ids) == 50 for o in finished.values())
    assert _all_free(llm)


def test_n_greater_than_one_with_seed_is_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    again = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert len(first.outputs) == 3
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "children use different seeds"


def test_stop_string_cuts_text_and_finishes(llm):
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = llm.generate("The little cat", greedy, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 6
    stop = full[3:6]
    out = llm.generate("The little cat", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                        stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate("The little cat", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                         stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full[:full.index(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    tokens = llm.generate([5, 6, 7], greedy, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = tokens[4]
    out = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                 stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hello"}],
                   SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                       add_generation_prompt=True)
    assert out.prompt_token_ids == tok.encode(expected, add_special_tokens=False)


def test_unknown_quantization_is_a_clear_error_and_fp8_generates():
    with pytest.raises(ValueError, match="unsupported quantization 'int3'.*fp8"):
        LLM(tiny_checkpoint(arch="llama"), device="cpu", num_gpu_blocks=8, quantization="int3")
    fp8 = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=64,
              quantization="fp8")
    assert fp8.engine.runner.kv_caches[0][0].dtype == torch.float32  # activations', not e4m3
    out = fp8.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and all(0 <= t < fp8.engine.vocab_size for t in out.token_ids)


def test_enforce_eager_leaves_the_callers_compile_config_as_given():
    """The same CompileConfig can then build a compiled engine next (it used to be set to "none")."""
    from vgraph.config import CompileConfig
    given = CompileConfig()
    eager = LLM(tiny_checkpoint(arch="llama"), dtype="float32", device="cpu", num_gpu_blocks=16,
                compile_config=given, enforce_eager=True)
    assert eager.engine.config.compile.level == "none"
    assert given.level == "compiled" and given.custom_ops is None


def test_a_detokenizer_failure_aborts_only_its_request(llm, monkeypatch, caplog):
    """An exception while detokenizing one request's token ends that request ("abort"),
    frees its blocks and leaves the others and the engine serving."""
    from vgraph.engine import detokenizer

    original = detokenizer.IncrementalDetokenizer.update
    marker = "<poisoned>"  # a stop string that marks the request whose detokenizer fails

    def update(self, token_ids):
        if marker in self.stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return original(self, token_ids)

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    healthy = llm.generate([{"prompt_token_ids": [7, 8, 9]}], params, use_tqdm=False)[0]
    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "update", update)
    poisoned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=[marker])
    with caplog.at_level("ERROR", logger="vgraph"):
        outs = llm.generate([{"prompt_token_ids": [11, 12, 13]}, {"prompt_token_ids": [7, 8, 9]}],
                            [poisoned, params], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "abort"
    assert outs[1].outputs[0].token_ids == healthy.outputs[0].token_ids
    assert outs[1].outputs[0].finish_reason == "length"
    assert sum("detokenizing request" in r.getMessage() for r in caplog.records) == 1
    assert _all_free(llm)
