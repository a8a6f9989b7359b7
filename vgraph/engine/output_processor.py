"""Turns the engine-core process's token deltas into the outputs the server hands its routes.

The core process runs ``LLMEngine(detokenize=False)``: it sends, per step, the new token ids
(and logprobs, finish reasons) of each request that advanced. This side keeps what a request
produced so far, detokenizes incrementally with the same ``IncrementalDetokenizer`` the
in-process engine uses, and builds the same cumulative ``RequestOutput``s. Stop strings are
found here: the sequence is finished for the client at once (its text cut, reason "stop"),
and ``process`` returns it so the caller tells the core to free it. Tokens the core made in
the meantime are dropped, as they are after an in-process stop.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from .core_codec import OutputDelta, SequenceDelta
from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput

logger = logging.getLogger("vgraph")

# A sequence the server ended: (request id, sequence index, stop string; None = aborted).
Finish = tuple[str, int, Optional[str]]


@dataclass
class _Sequence:
    detokenizer: IncrementalDetokenizer
    wants_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


@dataclass
class _Request:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    sequences: list[_Sequence]  # empty for a pooling request
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    """The server's half of each request: text, stop strings, cumulative outputs."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
            params: Union[SamplingParams, PoolingParams]) -> None:
        sequences = []
        if isinstance(params, SamplingParams):
            sequences = [_Sequence(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                          params.stop, params.include_stop_str_in_output),
                                   params.logprobs is not None)
                         for _ in range(params.n)]
        self._requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), sequences)

    def remove(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

    def process(self, deltas: list[OutputDelta]) -> tuple[list[Union[RequestOutput, EmbeddingRequestOutput]],
                                                          list[Finish]]:
        """The outputs of the requests that advanced, and the sequences the core must end."""
        outputs: list[Union[RequestOutput, EmbeddingRequestOutput]] = []
        finishes: list[Finish] = []
        for delta in deltas:
            request = self._requests.get(delta.request_id)
            if request is None:  # aborted, or finished here by a stop string
                continue
            if delta.embedding is not None:
                outputs.append(EmbeddingRequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                                      EmbeddingOutput(delta.embedding), True))
                del self._requests[request.request_id]
                continue
            request.num_cached_tokens = delta.num_cached_tokens
            if delta.prompt_logprobs is not None:
                request.prompt_logprobs = delta.prompt_logprobs
            for seq_delta in delta.sequences:
                finish = self._advance(request, seq_delta)
                if finish is not None:
                    finishes.append(finish)
            outputs.append(self._output(request))
            if request.finished:
                del self._requests[request.request_id]
        return outputs, finishes

    def _advance(self, request: _Request, delta: SequenceDelta) -> Optional[Finish]:
        """Adds a sequence's new tokens; returns the finish to report when a stop string ended it."""
        seq = request.sequences[delta.index]
        if seq.finish_reason is not None:
            return None
        seq.token_ids.extend(delta.new_token_ids)
        if delta.new_logprobs is not None:
            seq.logprobs.extend(delta.new_logprobs)
        seq.cumulative_logprob = delta.cumulative_logprob
        try:
            stop = seq.detokenizer.update(delta.new_token_ids)
        except Exception as exc:  # one request's text failing must not take the server down
            logger.error("detokenizing request %s failed (%s: %s); aborting it", request.request_id,
                         type(exc).__name__, exc)
            seq.finish_reason = "abort"
            return request.request_id, delta.index, None
        if stop is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop
            return request.request_id, delta.index, stop
        seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
        return None

    @staticmethod
    def _output(request: _Request) -> RequestOutput:
        completions = []
        for i, seq in enumerate(request.sequences):
            logprobs = list(seq.logprobs) if seq.wants_logprobs else None
            completions.append(CompletionOutput(i, seq.detokenizer.output_text, list(seq.token_ids),
                                                seq.cumulative_logprob if logprobs else None, logprobs,
                                                seq.finish_reason, seq.stop_reason))
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             request.finished, request.num_cached_tokens, request.prompt_logprobs)
