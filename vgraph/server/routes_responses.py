"""``POST /v1/responses``: OpenAI's Responses API over the chat path, streamed or not.

A response is one chat completion (one choice) in the Responses API's shape: the request's
``instructions`` and ``input`` become chat messages (responses_protocol.py), rendered by the
same chat template, sampled with the same ``SamplingParams`` checks and handed to the engine
by the same ``ServerState`` calls as ``/v1/chat/completions``, so a greedy response's text is
the chat route's text for that conversation. Nothing is stored: ``store`` is false.

Streams are typed server-sent events (``event: <type>`` plus ``data: {...}``, each with a
``sequence_number``), in the order OpenAI sends them, and end with ``response.completed``, or
``response.incomplete`` when ``max_output_tokens`` (or the context) ran out; there is no
``[DONE]`` line in this API.
"""
from __future__ import annotations

import itertools
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine.client import EngineDeadError, OutputCollector
from ..engine.outputs import RequestOutput
from ..sampling_params import SamplingParams
from .errors import APIError, engine_gone, internal_error
from .protocol import make_sampling_params
from .responses_protocol import FIELD_NAMES, ResponsesRequest
from .state import ServerState, usage
from .streaming import DeltaTracker, SSEResponse, sse

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body, model = await state.read_generation_request(request, ResponsesRequest)
    params = make_sampling_params({"max_tokens": body.max_output_tokens},
                                  {"temperature": body.temperature, "top_p": body.top_p},
                                  state.engine.max_logprobs, FIELD_NAMES, state.sampling_defaults)
    messages = await state.chat_messages(body.chat_messages(), param="input")
    text, ids = await state.encode_chat(messages, True, param="input")
    job = _Response(body, model, params)
    collector = await state.submit([(job.id, {"prompt": text, "prompt_token_ids": ids}, params)], "input",
                                   FIELD_NAMES, model=model)
    if body.stream:
        return SSEResponse(job.stream(state, collector))
    finals = await state.wait_finished(request, collector)
    return JSONResponse(job.response(finals[job.id]))


class _Response:
    """One response's ids and its JSON, in progress and final."""

    def __init__(self, body: ResponsesRequest, model: str, params: SamplingParams) -> None:
        self.body = body
        self.model = model
        self.params = params
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def envelope(self, status: str, output: list[dict[str, Any]],
                 output_usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """The response object; fields this server does not use carry their neutral values."""
        body = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created, "model": self.model,
                "status": status, "error": None, "incomplete_details": incomplete,
                "instructions": body.instructions, "metadata": body.metadata or {}, "output": output,
                "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
                "temperature": self.params.temperature, "top_p": self.params.top_p,
                "max_output_tokens": body.max_output_tokens, "previous_response_id": None, "reasoning": None,
                "store": False, "background": False, "text": {"format": {"type": "text"}},
                "truncation": "disabled", "user": body.user, "usage": output_usage}

    def message(self, text: str, status: str) -> dict[str, Any]:
        """The output message item (its one text part; none while a stream has not opened it)."""
        content = [text_part(text)] if status != "in_progress" else []
        return {"id": self.message_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def response(self, output: RequestOutput) -> dict[str, Any]:
        """The finished response: status from why generation stopped, usage in this API's words."""
        choice = output.outputs[0]  # n is 1
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        return self.envelope(status, [self.message(choice.text, status)], response_usage(output))

    async def stream(self, state: ServerState, collector: OutputCollector) -> AsyncIterator[bytes]:
        events = _Events(self.message_id)
        opening = self.envelope("in_progress", [])
        yield events.next("response.created", response=opening)
        yield events.next("response.in_progress", response=opening)
        yield events.next("response.output_item.added", output_index=0, item=self.message("", "in_progress"))
        yield events.next("response.content_part.added", **events.part(), part=text_part(""))
        tracker = DeltaTracker(self.params)
        latest: Optional[RequestOutput] = None
        try:
            while not collector.finished:
                for latest in (await collector.next()).values():
                    for choice in latest.outputs:  # one: n is 1
                        delta = tracker.text_delta(choice.text, choice.finish_reason is not None)
                        if delta:
                            yield events.next("response.output_text.delta", **events.part(), delta=delta,
                                              logprobs=[])
            if latest is None:
                raise RuntimeError("the engine finished the request without an output")
            for event in self._closing(events, self.response(latest)):
                yield event
        except EngineDeadError as exc:
            for event in self._failed(events, engine_gone(exc)):
                yield event
        except Exception as exc:  # a bug while building an event: end the stream properly, log one line
            for event in self._failed(events, internal_error("a responses stream failed", exc)):
                yield event
        finally:
            if not collector.finished:
                state.engine.abort([self.id])

    def _closing(self, events: "_Events", final: dict[str, Any]) -> list[bytes]:
        """The events that close the text part, the message and the response, in that order."""
        item = final["output"][0]
        part = item["content"][0]
        return [events.next("response.output_text.done", **events.part(), text=part["text"], logprobs=[]),
                events.next("response.content_part.done", **events.part(), part=part),
                events.next("response.output_item.done", output_index=0, item=item),
                events.next(f"response.{final['status']}", response=final)]

    def _failed(self, events: "_Events", error: APIError) -> list[bytes]:
        """A failure after the stream began: an ``error`` event, then ``response.failed``."""
        failed = {**self.envelope("failed", []), "error": {"code": error.code or "server_error",
                                                          "message": error.message}}
        return [events.next("error", code=error.code, message=error.message, param=error.param),
                events.next("response.failed", response=failed)]


class _Events:
    """Numbers a stream's events (``sequence_number`` counts from 0) and writes each as SSE."""

    def __init__(self, item_id: str) -> None:
        self._numbers = itertools.count()
        self._item_id = item_id

    def next(self, kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, "sequence_number": next(self._numbers), **fields}, event=kind)

    def part(self) -> dict[str, Any]:
        """Where the one text part is: its message, output 0, content 0."""
        return {"item_id": self._item_id, "output_index": 0, "content_index": 0}


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_usage(output: RequestOutput) -> dict[str, Any]:
    """The chat route's usage in the Responses API's names and details."""
    counts = usage([output])
    return {"input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
            "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"]}
