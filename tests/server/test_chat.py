"""``/v1/chat/completions`` through the official ``openai`` client."""
from __future__ import annotations

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


def _stream(client, model, **kwargs) -> tuple[dict[int, str], dict[int, str], list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, stream=True, **kwargs))
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, chunks


def test_chat_completion_uses_the_chat_template(server, client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=10, **GREEDY)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    (choice,) = out.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    templated = server.post("/tokenize", {"messages": MESSAGES}).json()
    assert out.usage.prompt_tokens == templated["count"]
    text = server.post("/detokenize", {"tokens": templated["tokens"]}).json()["prompt"]
    assert text.startswith("<|system|>\nYou are terse.") and text.endswith("<|assistant|>\n")
    assert out.usage.completion_tokens == 10 and out.usage.total_tokens == templated["count"] + 10


def test_streamed_chat_equals_non_streamed_for_greedy(client, model):
    full = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20, **GREEDY)
    texts, reasons, chunks = _stream(client, model, max_tokens=20, stream_options={"include_usage": True}, **GREEDY)
    assert texts[0] == full.choices[0].message.content and reasons[0] == "length"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()


def test_n_choices_streamed(client, model):
    texts, reasons, _ = _stream(client, model, n=2, max_tokens=6, seed=3, temperature=1.0,
                                extra_body={"ignore_eos": True})
    full = client.chat.completions.create(model=model, messages=MESSAGES, n=2, max_tokens=6, seed=3,
                                          temperature=1.0, extra_body={"ignore_eos": True})
    assert reasons == {0: "length", 1: "length"}
    assert [texts[0], texts[1]] == [c.message.content for c in sorted(full.choices, key=lambda c: c.index)]


def test_logprobs_and_top_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, logprobs=True,
                                         top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.bytes == list(entry.token.encode())
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, logprobs=True, **GREEDY)
    assert all(e.top_logprobs == [] for e in plain.choices[0].logprobs.content)
    streamed = [e for c in client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5, logprobs=True,
                                                          top_logprobs=2, stream=True, **GREEDY)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_content_parts_and_stop(client, model):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}]}]
    joined = [{"role": "user", "content": "Say\nhi"}]
    a = client.chat.completions.create(model=model, messages=parts, max_tokens=8, **GREEDY)
    b = client.chat.completions.create(model=model, messages=joined, max_tokens=8, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    text = b.choices[0].message.content
    stop = text[2:4]
    cut = client.chat.completions.create(model=model, messages=joined, max_tokens=8, stop=stop, **GREEDY)
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
