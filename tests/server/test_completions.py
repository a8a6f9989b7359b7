"""``/v1/completions`` through the official ``openai`` client: the shapes a client relies on."""
from __future__ import annotations

import math

GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def _stream_text(client, model, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    """Concatenated text and finish reason per choice index, and the chunks."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(client.completions.create(model=model, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_completion_and_usage(server, client, model):
    out = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=12, **GREEDY)
    assert out.object == "text_completion" and out.model == model and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.index == 0 and choice.text
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert out.usage.prompt_tokens == len(server.tokenize("The quick brown fox"))


def test_streamed_text_equals_non_streamed_for_greedy(client, model):
    kwargs = dict(prompt="Once upon a time", max_tokens=24, **GREEDY)
    full = client.completions.create(model=model, **kwargs)
    texts, reasons, chunks = _stream_text(client, model, stream_options={"include_usage": True}, **kwargs)
    assert texts[0] == full.choices[0].text and reasons[0] == "length"
    assert len(chunks) > 3, "text arrives in several chunks"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_is_cut_in_stream_and_not(client, model):
    base = client.completions.create(model=model, prompt="Hello", max_tokens=20, **GREEDY).choices[0].text
    stop = base[5:8]
    assert stop and stop in base
    full = client.completions.create(model=model, prompt="Hello", max_tokens=20, stop=[stop], **GREEDY)
    expected = base[:base.index(stop)]
    assert full.choices[0].text == expected and full.choices[0].finish_reason == "stop"
    assert full.choices[0].model_extra["stop_reason"] == stop
    texts, reasons, _ = _stream_text(client, model, prompt="Hello", max_tokens=20, stop=stop, **GREEDY)
    assert texts[0] == expected and reasons[0] == "stop"


def test_n_choices_and_seeded_sampling(client, model):
    kwargs = dict(prompt="Rain fell", max_tokens=8, n=3, temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    a = client.completions.create(model=model, **kwargs)
    b = client.completions.create(model=model, **kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices], "seeded sampling repeats"
    assert len({c.text for c in a.choices}) > 1, "each choice samples on its own"
    assert a.usage.completion_tokens == 3 * 8
    texts, _, _ = _stream_text(client, model, **kwargs)
    assert sorted(texts) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.text for c in sorted(a.choices, key=lambda c: c.index)]


def test_logprobs(client, model):
    out = client.completions.create(model=model, prompt="Water boils at", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and math.isfinite(value)
        assert 3 <= len(top) <= 4 and token in top
        assert max(top.values()) == value, "greedy picks the most likely token"
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=model, prompt="Water boils at", max_tokens=6, logprobs=3, stream=True, **GREEDY) if c.choices]
    tokens = [t for s in streamed if s for t in s.tokens]
    assert tokens == lp.tokens


def test_batch_of_prompts_and_token_ids(server, client, model):
    ids = server.tokenize("Good morning")
    single = client.completions.create(model=model, prompt="Good morning", max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=6, **GREEDY)
    assert by_ids.choices[0].text == single.choices[0].text
    batch = client.completions.create(model=model, prompt=["Good morning", "The sea was calm"], max_tokens=6,
                                      n=2, **GREEDY)
    assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
    first = next(c for c in batch.choices if c.index == 0)
    assert first.text == single.choices[0].text
    id_batch = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=4, **GREEDY)
    assert len(id_batch.choices) == 2
    assert batch.usage.completion_tokens == 4 * 6
    assert batch.usage.prompt_tokens == single.usage.prompt_tokens + len(server.tokenize("The sea was calm"))
    texts, _, chunks = _stream_text(client, model, prompt=["Good morning", "The sea was calm"], max_tokens=6,
                                    stream_options={"include_usage": True}, **GREEDY)
    assert sorted(texts) == [0, 1] and texts[0] == single.choices[0].text
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 12


def test_echo(client, model):
    out = client.completions.create(model=model, prompt="Echo me", max_tokens=4, echo=True, **GREEDY)
    plain = client.completions.create(model=model, prompt="Echo me", max_tokens=4, **GREEDY)
    assert out.choices[0].text == "Echo me" + plain.choices[0].text
    texts, _, _ = _stream_text(client, model, prompt="Echo me", max_tokens=4, echo=True, **GREEDY)
    assert texts[0] == out.choices[0].text


def test_vllm_sampling_extras_are_accepted(client, model):
    out = client.completions.create(model=model, prompt="Numbers like", max_tokens=8, temperature=0.8, top_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.5, seed=1,
                                    extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2,
                                                "min_tokens": 8, "stop_token_ids": [1],
                                                "skip_special_tokens": True})
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
