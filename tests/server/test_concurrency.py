"""Many streams at once, and clients that hang up mid-stream (their KV blocks must come back)."""
from __future__ import annotations

import asyncio

import httpx
import pytest


def test_64_concurrent_streams_finish_with_the_right_token_counts(server, model):
    async def one(client, i: int) -> tuple[int, str, int]:
        max_tokens = 8 + i % 9
        stream = await client.completions.create(
            model=model, prompt=f"Stream {i}: the market sold apples", max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True}, logprobs=0, extra_body={"ignore_eos": True})
        tokens, reason, usage = 0, None, None
        async for chunk in stream:
            for choice in chunk.choices:
                tokens += len(choice.logprobs.tokens) if choice.logprobs else 0
                reason = choice.finish_reason or reason
            usage = chunk.usage or usage
        assert usage.completion_tokens == tokens == max_tokens, (i, usage, tokens)
        return tokens, reason, max_tokens

    async def main() -> list:
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    results = asyncio.run(main())
    assert len(results) == 64 and all(reason == "length" and n == want for n, reason, want in results)
    server.wait_idle()


def test_disconnects_mid_stream_free_the_kv_cache(server, model):
    before = server.wait_idle()

    async def hang_up_after_first_chunk(client, i: int) -> int:
        stream = await client.completions.create(model=model, prompt=f"Disconnect {i}", max_tokens=400,
                                                 stream=True, extra_body={"ignore_eos": True})
        chunks = 0
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                chunks += 1
                if chunks == 2:
                    break
        await stream.close()
        return chunks

    async def main() -> list:
        async with server.async_client() as client:
            return await asyncio.gather(*(hang_up_after_first_chunk(client, i) for i in range(50)))

    assert asyncio.run(main()) == [2] * 50
    after = server.wait_idle(timeout=60)
    assert after["vgraph:kv_cache_usage_perc{engine=0}"] == 0.0
    assert after["vgraph:num_requests_running{engine=0}"] == 0 and after["vgraph:num_requests_waiting{engine=0}"] == 0
    aborted = after["vgraph:request_success_total{finished_reason=abort}"] - before[
        "vgraph:request_success_total{finished_reason=abort}"]
    assert aborted == 50
    generated = after["vgraph:generation_tokens_total"] - before["vgraph:generation_tokens_total"]
    assert generated < 50 * 400 / 2, "the aborted requests stopped generating"


def test_a_non_streaming_client_that_hangs_up_aborts_its_request(server, model):
    before = server.wait_idle()
    # The client gives up and closes the connection. 500 tokens of the demo model take ~0.25 s on
    # a quiet 2-core machine (0.4-0.5 ms a token), so the client waits 0.1 s.
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", {"model": model, "prompt": "Patience", "max_tokens": 500,
                                        "ignore_eos": True}, timeout=httpx.Timeout(30, read=0.1))
    after = server.wait_idle(timeout=30)
    key = "vgraph:request_success_total{finished_reason=abort}"
    assert after[key] - before[key] == 1
    assert after["vgraph:generation_tokens_total"] - before["vgraph:generation_tokens_total"] < 500
