"""``POST /v1/chat/completions``: messages through the chat template, n choices, streamed or not.

The template is rendered here (``--chat-template`` or the tokenizer's) and the engine gets
token ids, so what is generated from is exactly what ``/tokenize`` with the same messages
shows. Streams open each choice with a ``{"role": "assistant"}`` delta, as OpenAI's do (the
role is ``--response-role``, assistant by default, as in vLLM).
"""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine.client import EngineDeadError, OutputCollector
from ..engine.outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from .errors import engine_gone, internal_error
from .logprobs import chat_logprobs
from .protocol import ChatCompletionRequest
from .state import ServerState, usage
from .streaming import DONE, DeltaTracker, SSEResponse, sse
from .tools import ChoiceTools, ToolSetup, tool_setup

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body, model = await state.read_generation_request(request, ChatCompletionRequest)
    params = body.sampling_params(body.max_new_tokens, body.num_logprobs, state.engine.max_logprobs,
                                  body.field_names, state.sampling_defaults)
    tools = tool_setup(body.tools, body.tool_choice, body.parallel_tool_calls, state.settings.tool_call_parser)
    params = await state.constrain(body, params, tools.constraint)
    messages = await state.chat_messages(body.messages, params.n)
    text, ids = await state.encode_chat(messages, body.add_generation_prompt, tools=tools.template_tools)
    job = _Chat(state, body, model, params, tools)
    collector = await state.submit([(job.id, {"prompt": text, "prompt_token_ids": ids}, params)], "messages",
                                   body.field_names, model=model)
    if body.stream:
        return SSEResponse(job.stream(collector))
    finals = await state.wait_finished(request, collector)
    return JSONResponse(job.response(finals[job.id]))


class _Chat:
    def __init__(self, state: ServerState, body: ChatCompletionRequest, model: str,
                 params: SamplingParams, tools: ToolSetup) -> None:
        self.state = state
        self.body = body
        self.model = model
        self.params = params
        self.tools = tools
        self.readers: dict[int, Optional[ChoiceTools]] = {}  # per streamed choice
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, c: CompletionOutput, start: int, end: int) -> Optional[dict[str, Any]]:
        if self.params.logprobs is None:
            return None
        content = chat_logprobs(c.token_ids[start:end], (c.logprobs or [])[start:end], self.state.token_texts,
                                self.body.top_logprobs or 0)
        return {"content": content}

    def response(self, output: RequestOutput) -> dict[str, Any]:
        choices = []
        for c in output.outputs:
            message, reason = self._message(c)
            choices.append({"index": c.index, "message": message, "logprobs": self._logprobs(c, 0, len(c.token_ids)),
                            "finish_reason": reason, "stop_reason": c.stop_reason})
        return {**self._envelope("chat.completion", choices), "usage": usage([output])}

    def _message(self, c: CompletionOutput) -> tuple[dict[str, Any], Optional[str]]:
        """The reply's message (with tool_calls when tools are read) and the finish reason."""
        reader = self.tools.choice_tools()
        if reader is None:
            return {"role": self.state.settings.response_role, "content": c.text}, c.finish_reason
        message, reason = reader.message(c.text, c.finish_reason)
        return {**message, "role": self.state.settings.response_role}, reason

    async def stream(self, collector: OutputCollector) -> AsyncIterator[bytes]:
        trackers: dict[int, DeltaTracker] = {}
        latest: Optional[RequestOutput] = None
        with_usage = self.body.include_usage
        extra = {"usage": None} if with_usage else {}
        try:
            while not collector.finished:
                for output in (await collector.next()).values():
                    latest = output
                    for c in output.outputs:
                        if c.index not in trackers:
                            trackers[c.index] = DeltaTracker(self.params)
                            self.readers[c.index] = self.tools.choice_tools()
                            opening = {"role": self.state.settings.response_role, "content": ""}
                            role = {"index": c.index, "delta": opening, "logprobs": None, "finish_reason": None}
                            yield sse({**self._envelope("chat.completion.chunk", [role]), **extra})
                        chunk = self._chunk_choice(c, trackers[c.index])
                        if chunk is not None:
                            yield sse({**self._envelope("chat.completion.chunk", [chunk]), **extra})
            if with_usage and latest is not None:
                yield sse({**self._envelope("chat.completion.chunk", []), "usage": usage([latest])})
        except EngineDeadError as exc:
            yield engine_gone(exc).sse_chunk()
        except Exception as exc:  # a bug while building a chunk: end the stream properly, log one line
            yield internal_error("a chat stream failed", exc).sse_chunk()
        finally:
            if not collector.finished:
                self.state.engine.abort([self.id])
        yield DONE

    def _chunk_choice(self, c: CompletionOutput, tracker: DeltaTracker) -> Optional[dict[str, Any]]:
        if tracker.finished:
            return None
        finished = c.finish_reason is not None
        text = tracker.text_delta(c.text, finished)
        start, end = tracker.new_tokens(len(c.token_ids))
        logprobs = self._logprobs(c, start, end) if end > start else None
        reader = self.readers.get(c.index)
        if reader is None:  # new tokens without text yet stream as empty content (see routes_completions)
            delta: dict[str, Any] = {"content": text} if text or end > start else {}
            reason = c.finish_reason
        else:  # tool calls: content and call deltas from the text sent so far
            delta = reader.delta(c.text[:tracker.sent_chars], finished)
            reason = reader.finish_reason(c.finish_reason)
        if not (delta or logprobs or finished):
            return None
        tracker.finished = finished
        return {"index": c.index, "delta": delta, "logprobs": logprobs, "finish_reason": reason,
                "stop_reason": c.stop_reason if finished else None}
