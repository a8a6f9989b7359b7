"""The one accumulator: turns the engine's per-step token deltas into the outputs callers get.

``LLMEngine.step`` emits, per request that advanced, its new token ids (with logprobs), a
finish, prompt logprobs once, an embedding once. This class keeps what each request produced
so far, detokenizes incrementally (``IncrementalDetokenizer``), finds stop strings, groups the
``n`` sequences of a request, and builds ``RequestOutput``s in the kind each caller asked for
(``OutputKind``: cumulative for the server's streams, deltas, or final only for
``LLM.generate``). Every caller uses it: ``LLM``, and ``EngineClient`` over either transport
(the engine on a thread or in the engine-core process), so one output field is written in
two places: the engine's delta and here.

A stop string ends the sequence for the caller at once (text cut, reason "stop"), and
``process`` returns it so the caller tells the engine to free it (``finish_sequences``).
Tokens the engine made in the meantime are dropped.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer
from .outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, OutputDelta, OutputKind,
                      RequestOutput, SequenceDelta)

logger = logging.getLogger("vgraph")

# A sequence the caller ended: (request id, sequence index, stop string; None = aborted).
Finish = tuple[str, int, Optional[str]]
Output = Union[RequestOutput, EmbeddingRequestOutput]


@dataclass(slots=True)
class _Sequence:
    detokenizer: IncrementalDetokenizer
    wants_logprobs: bool
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    sent_tokens: int = 0  # what DELTA outputs have handed out so far
    sent_chars: int = 0


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    kind: OutputKind
    sequences: list[_Sequence]  # empty for a pooling request
    num_cached_tokens: int = 0
    prompt_logprobs: Optional[list[Optional[dict[int, float]]]] = None

    @property
    def finished(self) -> bool:
        sequences = self.sequences
        if len(sequences) == 1:  # most requests: no generator
            return sequences[0].finish_reason is not None
        return all(s.finish_reason is not None for s in sequences)


class OutputProcessor:
    """Each request's text, stop strings and outputs, from the engine's deltas."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._requests: dict[str, _Request] = {}

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list[int],
            params: Union[SamplingParams, PoolingParams], kind: OutputKind = OutputKind.CUMULATIVE) -> None:
        sequences = []
        if isinstance(params, SamplingParams):
            sequences = [_Sequence(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                          params.stop, params.include_stop_str_in_output),
                                   params.logprobs is not None)
                         for _ in range(params.n)]
        self._requests[request_id] = _Request(request_id, prompt, list(prompt_token_ids), kind, sequences)

    def remove(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._requests.pop(rid, None)

    def __len__(self) -> int:
        return len(self._requests)

    def process(self, deltas: list[OutputDelta]) -> tuple[list[Output], list[Finish]]:
        """The outputs due to callers, and the sequences the engine must end (stop strings)."""
        outputs: list[Output] = []
        finishes: list[Finish] = []
        for delta in deltas:
            request = self._requests.get(delta.request_id)
            if request is None:  # aborted, or finished here by a stop string
                continue
            if delta.embedding is not None:
                outputs.append(EmbeddingRequestOutput(request.request_id, request.prompt, request.prompt_token_ids,
                                                      EmbeddingOutput(list(delta.embedding)), True))
                del self._requests[request.request_id]
                continue
            request.num_cached_tokens = delta.num_cached_tokens
            if delta.prompt_logprobs is not None:
                request.prompt_logprobs = delta.prompt_logprobs
            for seq_delta in delta.sequences:
                finish = self._advance(request, seq_delta)
                if finish is not None:
                    finishes.append(finish)
            finished = request.finished
            if finished or request.kind is not OutputKind.FINAL_ONLY:
                outputs.append(self._output(request, finished))
            if finished:
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
            seq.cumulative_logprob += sum(lp[t] for t, lp in zip(delta.new_token_ids, delta.new_logprobs))
        try:
            stop = seq.detokenizer.update(delta.new_token_ids)
        except Exception as exc:  # one request's text failing must not take the caller down
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
    def _output(request: _Request, finished: bool) -> RequestOutput:
        delta = request.kind is OutputKind.DELTA
        completions = [_completion(i, seq, delta) for i, seq in enumerate(request.sequences)]
        return RequestOutput(request.request_id, request.prompt, request.prompt_token_ids, completions,
                             finished, request.num_cached_tokens, request.prompt_logprobs)


def _completion(index: int, seq: _Sequence, delta: bool) -> CompletionOutput:
    """A sequence's output: everything so far, or (``delta``) what is new since the last one."""
    text, tokens = seq.detokenizer.output_text, seq.token_ids
    wanted = cumulative = None
    if delta:
        text, tokens = text[seq.sent_chars:], tokens[seq.sent_tokens:]
        if seq.wants_logprobs:
            wanted = seq.logprobs[seq.sent_tokens:]
        seq.sent_chars, seq.sent_tokens = len(seq.detokenizer.output_text), len(seq.token_ids)
    else:
        tokens = list(tokens)
        if seq.wants_logprobs:
            wanted = list(seq.logprobs)
    if seq.wants_logprobs and seq.logprobs:
        cumulative = seq.cumulative_logprob
    return CompletionOutput(index, text, tokens, cumulative, wanted, seq.finish_reason, seq.stop_reason)
