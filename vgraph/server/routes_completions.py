"""``POST /v1/completions``: one or many prompts (text or token ids), n choices each, streamed or not.

A batch of prompts becomes one engine request per prompt, submitted atomically (a bad prompt
anywhere rejects the whole call with nothing left running). Choice ``index`` is
``prompt_index * n + i``, as in OpenAI's API.

Text prompts are tokenized here, within the request limits (limits.py) and off the event loop
when large (tokenization.py), and reach the engine as token ids with their text: the engine
thread, which steps every running request, never waits on a tokenizer.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..engine.client import EngineDeadError, OutputCollector
from ..engine.outputs import CompletionOutput, RequestOutput
from ..sampling_params import SamplingParams
from ..engine.inputs import PromptType
from .errors import engine_gone, internal_error
from .logprobs import completion_logprobs, join_logprobs, prompt_logprobs_part
from .protocol import CompletionRequest
from .state import ServerState, usage
from .streaming import DONE, DeltaTracker, SSEResponse, sse

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state: ServerState = request.app.state.server
    body, model = await state.read_generation_request(request, CompletionRequest)
    prompts = body.prompts()
    params = body.sampling_params(body.max_tokens, body.logprobs, state.engine.max_logprobs,
                                  defaults=state.sampling_defaults)
    if body.prompt_logprobs is not None:  # echo + logprobs: the prompt is scored in its prefill
        params = replace(params, prompt_logprobs=body.prompt_logprobs)
    params = await state.constrain(body, params)
    inputs = await _engine_inputs(state, prompts, params.n)
    job = _Completion(state, body, model, params, len(prompts))
    collector = await state.submit([(rid, p, params) for rid, p in zip(job.ids, inputs)], model=model)
    if body.echo:  # once the engine has accepted the token ids, they decode
        try:
            job.echoes = [await _echo_text(state, p) for p in prompts]
        except BaseException:
            state.engine.abort(job.ids)
            raise
    if body.stream:
        return SSEResponse(job.stream(collector))
    finals = await state.wait_finished(request, collector)
    return JSONResponse(job.response([finals[rid] for rid in job.ids]))


async def _engine_inputs(state: ServerState, prompts: list[Union[str, list[int]]], n: int) -> list[PromptType]:
    """Each prompt as the engine takes it: token ids, with the text when there is one. Checked
    against the limits before tokenizing (characters, counts) and after (tokens)."""
    limits = state.limits
    limits.check_prompts(prompts, n)

    def check(i: int, ids: list[int]) -> None:
        limits.check_tokens(len(ids), "the prompt" if len(prompts) == 1 else f"prompt {i}", "prompt")

    ids = await state.tokenizer.encode_prompts(prompts, check)
    return [{"prompt": p, "prompt_token_ids": t} if isinstance(p, str) else t for p, t in zip(prompts, ids)]


async def _echo_text(state: ServerState, prompt: Union[str, list[int]]) -> str:
    """The prompt as ``echo`` shows it: as given, or decoded from its token ids."""
    return prompt if isinstance(prompt, str) else await state.tokenizer.decode(prompt, param="prompt")


class _Completion:
    """One completions call: builds its response, or its stream of chunks."""

    def __init__(self, state: ServerState, body: CompletionRequest, model: str, params: SamplingParams,
                 num_prompts: int) -> None:
        self.state = state
        self.body = body
        self.model = model
        self.params = params
        self.echoes = [""] * num_prompts  # per prompt: the text echo puts before the completion
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.ids = [f"{self.id}-{i}" for i in range(num_prompts)]
        self.prompt_index = {rid: i for i, rid in enumerate(self.ids)}
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices}

    def _index(self, prompt_index: int, choice: CompletionOutput) -> int:
        return prompt_index * self.params.n + choice.index

    def _prompt_part(self, output: RequestOutput) -> Optional[dict[str, Any]]:
        """With echo and logprobs: the prompt tokens' logprobs, which lead each choice's."""
        if self.params.prompt_logprobs is None:
            return None
        scored = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
        return prompt_logprobs_part(output.prompt_token_ids, scored, self.state.token_texts)[0]

    def response(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for p, output in enumerate(outputs):
            prefix = self.echoes[p]
            prompt_part = self._prompt_part(output)
            for c in output.outputs:
                logprobs = None
                if self.params.logprobs is not None:
                    logprobs, _ = completion_logprobs(c.token_ids, c.logprobs or [], self.state.token_texts,
                                                      len(prefix))
                    if prompt_part is not None:
                        logprobs = join_logprobs(prompt_part, logprobs)
                choices.append({"index": self._index(p, c), "text": prefix + c.text, "logprobs": logprobs,
                                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        return {**self._envelope(choices), "usage": usage(outputs)}

    async def stream(self, collector: OutputCollector) -> AsyncIterator[bytes]:
        trackers: dict[tuple[int, int], DeltaTracker] = {}
        offsets: dict[tuple[int, int], int] = {}
        latest: dict[str, RequestOutput] = {}
        with_usage = self.body.include_usage
        try:
            while not collector.finished:
                for rid, output in (await collector.next()).items():
                    latest[rid] = output
                    p = self.prompt_index[rid]
                    for c in output.outputs:
                        key = (p, c.index)
                        if key not in trackers:
                            prefix = self.echoes[p]
                            trackers[key] = DeltaTracker(self.params, prefix)
                            offsets[key] = len(prefix)
                        chunk = self._chunk_choice(p, output, c, trackers[key], offsets, key)
                        if chunk is not None:
                            yield sse({**self._envelope([chunk]), **({"usage": None} if with_usage else {})})
            if with_usage:
                yield sse({**self._envelope([]), "usage": usage([latest[rid] for rid in self.ids])})
        except EngineDeadError as exc:
            yield engine_gone(exc).sse_chunk()
        except Exception as exc:  # a bug while building a chunk: end the stream properly, log one line
            yield internal_error("a completions stream failed", exc).sse_chunk()
        finally:
            if not collector.finished:
                self.state.engine.abort(self.ids)
        yield DONE

    def _chunk_choice(self, p: int, output: RequestOutput, c: CompletionOutput, tracker: DeltaTracker,
                      offsets: dict[tuple[int, int], int], key: tuple[int, int]) -> Optional[dict[str, Any]]:
        if tracker.finished:
            return None
        first = not tracker.started  # the chunk that carries the echoed prompt
        if first and self.params.prompt_logprobs is not None and output.prompt_logprobs is None:
            return None  # the prompt is not fully scored yet: the next snapshot will be
        finished = c.finish_reason is not None
        text = tracker.text_delta(c.text, finished)
        logprobs = None
        start, end = tracker.new_tokens(len(c.token_ids))
        if self.params.logprobs is not None:
            if end > start:
                logprobs, offsets[key] = completion_logprobs(c.token_ids[start:end], (c.logprobs or [])[start:end],
                                                             self.state.token_texts, offsets[key])
            if first and self.params.prompt_logprobs is not None:
                logprobs = join_logprobs(self._prompt_part(output), logprobs)
        # New tokens are streamed even when they add no text yet (a partial UTF-8 character, a
        # held-back stop-string prefix), as vLLM does: a client sees one event per step, not a
        # gap as long as the run of such tokens (issue 33: random tokens of a byte-level
        # vocabulary complete no character ~25% of the time).
        if not (text or logprobs or finished or end > start):
            return None
        tracker.finished = finished
        return {"index": self._index(p, c), "text": text, "logprobs": logprobs,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason if finished else None}
