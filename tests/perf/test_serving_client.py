"""The served load generator (perf/suites/serving.py) against a scripted SSE server: what it
counts as tokens, events and gaps, and that a stream short of its tokens is an error."""
from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from perf.suites.serving import _closed_level, stream_record


def _event(tokens: list[str]) -> bytes:
    logprobs = {"tokens": tokens, "token_logprobs": [-0.1] * len(tokens)} if tokens else None
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": "".join(tokens), "logprobs": logprobs}]}).encode() \
        + b"\n\n"


async def _serve(script: list[list[str]], run):
    """Runs ``run(url)`` against a server that answers every completion with ``script``'s
    events (each a list of tokens; an empty list is an event without logprobs), split across
    writes mid-line, then ``[DONE]``."""
    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for tokens in script:
            data = _event(tokens)
            await response.write(data[:9])  # a line split across chunks must still parse
            await response.write(data[9:])
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await run(f"http://127.0.0.1:{port}"), bodies
    finally:
        await runner.cleanup()


def test_a_closed_level_counts_tokens_by_their_logprobs_entries():
    script = [["a"], [], ["b", "c"], ["d"]]  # 4 tokens in 3 token-carrying events

    level, bodies = asyncio.run(_serve(script, lambda url: _closed_level(url, 2, 5, 4, offset=0)))

    assert level["requests"] == 5 and len(bodies) == 5
    assert level["tokens_per_event"] == pytest.approx(4 / 3)
    assert level["itl_ms"]["samples"] == 5 * 3  # the 2-token event counts as two gaps
    assert all(b["stream"] and b["logprobs"] == 0 and b["max_tokens"] == 4 for b in bodies)
    assert sorted(b["prompt"].split(":")[0] for b in bodies) == ["0", "1", "2", "3", "4"]


def test_a_stream_short_of_its_tokens_fails_the_level():
    with pytest.raises(RuntimeError, match="streamed 2 tokens, expected 4"):
        asyncio.run(_serve([["a"], ["b"]], lambda url: _closed_level(url, 1, 1, 4, offset=0)))


def test_stream_record_spreads_an_events_wait_over_its_tokens():
    record = stream_record(0, 4, sent=10.0, events=[(10.5, 1), (10.7, 2), (11.0, 1)], done=11.1, scheduled=None)

    assert record["ttft"] == pytest.approx(0.5)
    assert record["gaps"] == pytest.approx([0.1, 0.1, 0.3])
    assert record["tpot"] == pytest.approx(0.6 / 3)
    assert record["events"] == 3 and record["late"] is None
