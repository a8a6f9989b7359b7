"""``/v1/completions`` with ``echo`` and ``logprobs``: the prompt's logprobs lead each choice's,
as OpenAI gives them (the first token's ``null``), equal to transformers' log-softmax on the
same checkpoint (fp32, 1e-4); ``max_tokens: 0`` with echo scores the prompt alone; token-id
and batched prompts, n > 1 and streaming; bad combinations are a 400 naming the field."""
from __future__ import annotations

import json

import pytest

from tests.engine.hf_oracle import hf_greedy, hf_prompt_logprobs

from .conftest import TINY_MODEL

TOL = 1e-4
# 40+ tokens: longer than the server's 32-token step, so it is scored over two chunks.
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs back home again."


def _check_prompt_part(server, ids: list[int], logprobs: dict, top_n: int) -> None:
    ref = hf_prompt_logprobs(server.checkpoint, tuple(ids))
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for j in range(1, len(ids)):
        assert abs(logprobs["token_logprobs"][j] - ref[j - 1, ids[j]].item()) < TOL, f"prompt token {j}"
        top = logprobs["top_logprobs"][j]
        assert len(top) <= top_n + 1
        # Keyed by token text, so tokens with the same text (U+FFFD halves) share one key:
        # every value shown is the prompt token's or one of the model's top-n.
        allowed = ref[j - 1].topk(top_n).values.tolist() + [ref[j - 1, ids[j]].item()] if top_n else \
            [ref[j - 1, ids[j]].item()]
        for value in top.values():
            assert min(abs(value - a) for a in allowed) < TOL


def _check_offsets(text: str, logprobs: dict) -> None:
    """Each token's text sits at its offset in the returned text."""
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"]):
        assert text[offset:offset + len(token)] == token


def test_echo_with_max_tokens_zero_scores_the_prompt(tiny_server):
    ids = tiny_server.tokenize(PROMPT)
    assert len(ids) > 32
    out = tiny_server.client().completions.create(model=TINY_MODEL, prompt=PROMPT, echo=True, logprobs=2,
                                                   max_tokens=0)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    lp = choice.logprobs.model_dump()
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == PROMPT
    _check_prompt_part(tiny_server, ids, lp, 2)
    _check_offsets(choice.text, lp)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)


def test_echo_with_generation_puts_the_prompt_first(tiny_server):
    ids = tiny_server.tokenize("Once upon a time")
    body = {"model": TINY_MODEL, "prompt": "Once upon a time", "echo": True, "logprobs": 1, "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}
    choice = tiny_server.post("/v1/completions", body).json()["choices"][0]
    lp = choice["logprobs"]
    expected, step_lps = hf_greedy(tiny_server.checkpoint, tuple(ids), 4)
    assert len(lp["tokens"]) == len(ids) + 4
    _check_prompt_part(tiny_server, ids, lp, 1)
    for k, (token, ref) in enumerate(zip(expected, step_lps)):
        assert abs(lp["token_logprobs"][len(ids) + k] - ref[token].item()) < TOL
    assert choice["text"].startswith("Once upon a time")
    _check_offsets(choice["text"], lp)


def test_token_id_prompts_batched_with_n(tiny_server):
    prompts = [[45, 356, 84, 271, 297], [7, 8, 9, 10, 11, 12, 13]]
    body = {"model": TINY_MODEL, "prompt": prompts, "echo": True, "logprobs": 0, "max_tokens": 1, "n": 2,
            "temperature": 1.0, "seed": 1}
    response = tiny_server.post("/v1/completions", body).json()
    choices = sorted(response["choices"], key=lambda c: c["index"])
    assert len(choices) == 4
    for choice in choices:
        ids = prompts[choice["index"] // 2]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 1
        prompt_part = {k: v[:len(ids)] for k, v in lp.items()}
        _check_prompt_part(tiny_server, ids, prompt_part, 0)
        assert all(len(t) == 1 for t in lp["top_logprobs"][1:len(ids)]), "logprobs 0: the token alone"
        _check_offsets(choice["text"], prompt_part)  # (a generated half character shows no text)
    assert response["usage"]["prompt_tokens"] == 12 and response["usage"]["completion_tokens"] == 4


def test_streamed_echo_sends_the_prompt_in_the_first_chunk(tiny_server):
    body = {"model": TINY_MODEL, "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}
    full = tiny_server.post("/v1/completions", body).json()["choices"][0]
    response = tiny_server.post("/v1/completions", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    first = events[0]["choices"][0]
    assert first["text"].startswith(PROMPT) and first["logprobs"]["token_logprobs"][0] is None
    text = "".join(e["choices"][0]["text"] for e in events)
    tokens = [t for e in events for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    values = [v for e in events for v in (e["choices"][0]["logprobs"] or {}).get("token_logprobs", [])]
    offsets = [o for e in events for o in (e["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert text == full["text"] and tokens == full["logprobs"]["tokens"]
    assert values == full["logprobs"]["token_logprobs"] and offsets == full["logprobs"]["text_offset"]


def test_streamed_echo_with_max_tokens_zero(tiny_server):
    body = {"model": TINY_MODEL, "prompt": "Hi there", "echo": True, "logprobs": 0, "max_tokens": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    response = tiny_server.post("/v1/completions", body)
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert len(choices) == 1 and choices[0]["text"] == "Hi there" and choices[0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 0


def test_echo_without_logprobs_and_logprobs_without_echo_are_unchanged(tiny_server):
    out = tiny_server.post("/v1/completions", {"model": TINY_MODEL, "prompt": "Hi", "echo": True,
                                               "max_tokens": 0}).json()["choices"][0]
    assert out["text"] == "Hi" and out["logprobs"] is None
    out = tiny_server.post("/v1/completions", {"model": TINY_MODEL, "prompt": "Hi", "logprobs": 1,
                                               "max_tokens": 2}).json()["choices"][0]
    assert len(out["logprobs"]["tokens"]) == 2 and out["logprobs"]["token_logprobs"][0] is not None


@pytest.mark.parametrize("route,body,param,words", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens", "only allowed with echo"),
    ("/v1/completions", {"prompt": "Hi", "echo": True, "logprobs": 6, "max_tokens": 0}, "logprobs", "maximum of 5"),
    ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "echo", "valid boolean"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "echo": True}, "echo",
     "not supported in chat"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 0},
     "max_completion_tokens", "at least 1"),
])
def test_bad_combinations_are_a_400_naming_the_field(tiny_server, route, body, param, words):
    response = tiny_server.post(route, {"model": TINY_MODEL, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert tiny_server.post("/v1/completions", {"model": TINY_MODEL, "prompt": "Hi", "max_tokens": 1}).status_code == 200
