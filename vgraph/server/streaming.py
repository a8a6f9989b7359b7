"""Server-sent events, streamed text deltas, and noticing clients that went away.

Text deltas are diffs of the engine's cumulative text with one subtlety, the same one the
engine's detokenizer handles for offline callers: while a sequence runs, its last
``max stop length - 1`` characters may be the start of a stop string that will be cut from
the final text, so they are held back until the sequence finishes. That way the concatenated
stream always equals the non-streamed text.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator, Callable, Optional

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ..sampling_params import SamplingParams

logger = logging.getLogger("vgraph.server")

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any], event: Optional[str] = None) -> bytes:
    """One event: ``data: <json>`` and a blank line, after ``event: <name>`` when the API names
    its events (the Responses API does; completions and chat do not)."""
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


class SSEResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its generator.

    When the client disconnects, Starlette cancels the sending task, which may leave the
    generator suspended at a ``yield``; closing it here runs its ``finally`` (which aborts the
    engine requests) at once instead of whenever the garbage collector gets to it.

    Backpressure needs no queue here: each event is sent before the generator is asked for the
    next, uvicorn's ``send`` waits while the connection's write buffer is full, and the
    engine's ``OutputCollector`` keeps only the latest output of each request, so a client that
    reads slowly gets fewer, larger deltas and one that stops reading costs a bounded buffer
    until the connection's stall deadline resets it (connections.py), which lands here as a
    disconnect and aborts the request.
    """

    def __init__(self, content: AsyncIterator[bytes]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._generator = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self._generator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except (RuntimeError, asyncio.CancelledError):  # already running or cancelled
                    pass


class DeltaTracker:
    """What one choice has streamed so far: characters, tokens (for logprobs) and offsets."""

    def __init__(self, params: SamplingParams, prefix: str = "") -> None:
        stops = params.stop if isinstance(params.stop, list) else []
        longest = max((len(s) for s in stops), default=0)
        self._hold = 0 if params.include_stop_str_in_output else max(longest - 1, 0)
        self.sent_chars = 0
        self.sent_tokens = 0
        self.prefix = prefix  # text sent before the first delta (echoed prompt)
        self.started = False
        self.finished = False

    def text_delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else max(self.sent_chars, len(text) - self._hold)
        delta = text[self.sent_chars:end]
        self.sent_chars = end
        if not self.started:
            self.started = True
            delta = self.prefix + delta
        return delta

    def new_tokens(self, num_tokens: int) -> tuple[int, int]:
        """The token range not yet reported, marking it reported."""
        start, self.sent_tokens = self.sent_tokens, num_tokens
        return start, num_tokens


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectWatch:
    """Calls ``on_disconnect`` if the client hangs up while a non-streaming request runs.

    Starlette notices disconnects of streaming responses itself; a handler that is awaiting
    the engine, though, would otherwise keep generating for nobody until the request ends.
    The body must already be read (the watcher consumes the receive channel).
    """

    def __init__(self, request: Request, on_disconnect: Callable[[], None]) -> None:
        self._request = request
        self._on_disconnect = on_disconnect
        self._task: Optional[asyncio.Task] = None

    async def __aenter__(self) -> "DisconnectWatch":
        self._task = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _watch(self) -> None:
        try:
            await _wait_for_disconnect(self._request)
        except asyncio.CancelledError:
            raise
        except Exception:  # the ASGI channel is closed: treat as gone
            pass
        logger.info("client disconnected; aborting its request")
        self._on_disconnect()
