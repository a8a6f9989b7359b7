"""``/v1/embeddings`` through a real server and the official ``openai`` client: embeddings equal
transformers' final-norm hidden states pooled the same way (fp32), for strings, token ids and
batches, as floats and as base64; bad input is a 400 in OpenAI's shape and the server keeps
answering; embeddings and generation run side by side."""
from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
import torch

from tests.engine.hf_oracle import hf_embedding

from .conftest import EAGER_ARGS, TINY_MODEL, ServerProcess

TOL = 1e-5
TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog, and then it runs back home again."]


def _close(got, want: torch.Tensor, tol: float = TOL) -> bool:
    return (torch.tensor(got, dtype=torch.float32) - want).abs().max().item() < tol


def test_float_embeddings_equal_transformers(tiny_server):
    client = tiny_server.client()
    out = client.embeddings.create(model=TINY_MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in out.data] == [0, 1] and out.model == TINY_MODEL
    total = 0
    for text, item in zip(TEXTS, out.data):
        ids = tiny_server.tokenize(text)
        total += len(ids)
        assert _close(item.embedding, hf_embedding(tiny_server.checkpoint, ids, "last"))
    assert out.usage.prompt_tokens == total == out.usage.total_tokens


def test_base64_round_trips_through_the_openai_client(tiny_server):
    client = tiny_server.client()
    floats = client.embeddings.create(model=TINY_MODEL, input=TEXTS[1], encoding_format="float").data[0].embedding
    # Without encoding_format the client asks for base64 and decodes it itself.
    decoded = client.embeddings.create(model=TINY_MODEL, input=TEXTS[1]).data[0].embedding
    assert decoded == pytest.approx(floats, abs=0)  # the same float32 values, bit for bit
    raw = tiny_server.post("/v1/embeddings", {"input": TEXTS[1], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert vector.tolist() == pytest.approx(floats, abs=0)


def test_token_id_inputs(tiny_server):
    ids = [[45, 356, 84, 271], [7, 8, 9, 10, 11, 12] * 8]  # the second spans two 32-token steps
    out = tiny_server.client().embeddings.create(model=TINY_MODEL, input=ids, encoding_format="float")
    for prompt, item in zip(ids, out.data):
        assert _close(item.embedding, hf_embedding(tiny_server.checkpoint, prompt, "last"))
    single = tiny_server.client().embeddings.create(model=TINY_MODEL, input=ids[0], encoding_format="float")
    assert single.data[0].embedding == out.data[0].embedding and single.usage.prompt_tokens == 4


@pytest.mark.parametrize("body,status,param,words", [
    ({"input": ""}, 400, "input", "empty"),
    ({"input": []}, 400, "input", "empty"),
    ({"input": [[]]}, 400, "input", "empty"),
    ({"input": ["ok", ""]}, 400, "input", "input[1] is empty"),
    ({"input": 5}, 400, "input", "input"),
    ({"input": [1.5]}, 400, "input", "input"),
    ({"input": [10**7]}, 400, "input", "outside the vocabulary"),
    ({"input": [1] * 600}, 400, "input", "maximum context length is 512 tokens"),
    ({"input": "x" * 20_000}, 400, "input", "characters"),
    ({"input": "hi", "dimensions": 8}, 400, "dimensions", "not supported"),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", "encoding_format"),
    ({}, 400, "input", "required"),
    ({"input": "hi", "model": "nope"}, 404, "model", "does not exist"),
])
def test_bad_input_is_an_openai_error_and_the_server_keeps_answering(tiny_server, body, status, param, words):
    response = tiny_server.post("/v1/embeddings", body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and words in error["message"], error
    assert tiny_server.post("/v1/embeddings", {"input": "still here"}).status_code == 200


def test_openai_client_raises_bad_request(tiny_server):
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        tiny_server.client().embeddings.create(model=TINY_MODEL, input="hi", dimensions=4)


def test_embeddings_and_generation_concurrently(tiny_server):
    """Concurrent embeddings and completions get what each gets alone; nothing is left held."""
    path = tiny_server.checkpoint
    prompt_ids = tiny_server.tokenize(TEXTS[1])

    async def run() -> tuple[list, list]:
        client = tiny_server.async_client()
        embeds = [client.embeddings.create(model=TINY_MODEL, input=[TEXTS[i % 2]] * 3, encoding_format="float")
                  for i in range(6)]
        gens = [client.completions.create(model=TINY_MODEL, prompt=prompt_ids, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}) for _ in range(6)]
        results = await asyncio.gather(*embeds, *gens)
        await client.close()
        return results[:6], results[6:]

    embeds, gens = asyncio.run(run())
    want = [hf_embedding(path, tiny_server.tokenize(t), "last") for t in TEXTS]
    for i, out in enumerate(embeds):
        assert all(_close(d.embedding, want[i % 2]) for d in out.data)
    alone = tiny_server.client().completions.create(model=TINY_MODEL, prompt=prompt_ids, max_tokens=12,
                                                    temperature=0, extra_body={"ignore_eos": True})
    assert all(g.choices[0].text == alone.choices[0].text for g in gens)
    metrics = tiny_server.wait_idle()
    assert metrics["vgraph:request_success_total{finished_reason=length}"] >= 6 + 18


def test_mean_pooling_without_normalization_is_a_serve_flag():
    from tests.checkpoints import tiny_checkpoint

    path = tiny_checkpoint(arch="llama")
    server = ServerProcess("--model", path, *EAGER_ARGS, "--dtype", "float32", "--pooling-type", "mean",
                           "--no-pooling-normalize", "--max-num-batched-tokens", "16")
    try:
        server.wait_ready()
        ids = server.tokenize(TEXTS[1])
        out = server.client().embeddings.create(model=path, input=TEXTS[1], encoding_format="float")
        want = hf_embedding(path, ids, "mean", normalize=False)
        assert _close(out.data[0].embedding, want, 1e-4)
        assert abs(torch.tensor(out.data[0].embedding).norm().item() - 1) > 1e-3, "not normalized"
    finally:
        server.close()
