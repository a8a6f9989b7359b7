"""The messages between the server process and the engine-core process, as msgpack.

Why msgpack with explicit encodings and not pickle: a pickle from the socket could run any
code in the receiving process, and it couples both sides to the exact classes and module
paths of the moment. Here every message is a list whose first item names its kind, built
only of msgpack's own types (ints, floats, strings, lists, maps with int or string keys,
None), and each type that crosses the boundary has one encoder and one decoder below.
msgpack is compact and fast in both directions (a C extension), keeps map order (a token's
logprobs list the chosen token first) and int map keys (token ids), and pyzmq carries the
bytes. Floats travel as float64, so logprobs and embeddings arrive bit-exact.

Server -> core: ``add``, ``abort``, ``finish`` (sequences the server ended: a stop string
found while detokenizing), ``shutdown``.
Core -> server: ``ready`` (facts about the engine), ``startup_failed``, ``accepted`` (one per
``add``), ``step`` (token deltas, timings, stats) and ``fatal``.
"""
from __future__ import annotations

import builtins
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import msgpack

from ..lora.request import LoRARequest
from ..pooling_params import PoolingParams
from ..sampling_params import SamplingParams
from .inputs import ContextLengthError, InputError
from .outputs import OutputDelta, SequenceDelta
from .stats import EngineStats, RequestTiming

# Kinds of message, the first item of each.
ADD, ABORT, FINISH, SHUTDOWN = "add", "abort", "finish", "shutdown"
LOAD_LORA, UNLOAD_LORA = "load_lora", "unload_lora"
READY, STARTUP_FAILED, ACCEPTED, STEP, FATAL = "ready", "startup_failed", "accepted", "step", "fatal"

_SAMPLING, _POOLING = "s", "p"


def pack(message: list) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def encode_message(message: list) -> bytes:
    """``pack`` for a message built from a caller's input: what msgpack cannot carry (an int
    beyond 64 bits, an unknown type) is the caller's ``ValueError``, not a server error."""
    try:
        return pack(message)
    except (OverflowError, TypeError, ValueError) as exc:
        raise ValueError(f"the request cannot be sent to the engine process: {exc}") from None


def unpack(data: bytes) -> list:
    # Int map keys are token ids (logprobs); lists stay lists (no tuples).
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---------------------------------------------------------------------------- parameters

def encode_lora(lora: Optional[LoRARequest]) -> Optional[list]:
    return None if lora is None else [lora.lora_name, lora.lora_int_id, lora.lora_path]


def decode_lora(data: Optional[list]) -> Optional[LoRARequest]:
    return None if data is None else LoRARequest(*data)


def encode_params(params: Union[SamplingParams, PoolingParams]) -> list:
    """``[kind, {field: value}]``: every field by name, the structured-output spec as its fields."""
    if isinstance(params, PoolingParams):
        return [_POOLING, {"pooling_type": params.pooling_type, "normalize": params.normalize}]
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)
              if f.name not in ("structured_outputs", "guided_decoding")}
    spec = params.structured_outputs
    if spec is not None:
        fields["structured_outputs"] = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    return [_SAMPLING, fields]


def decode_params(data: list) -> Union[SamplingParams, PoolingParams]:
    kind, fields = data
    if kind == _POOLING:
        return PoolingParams(**fields)
    if kind != _SAMPLING:
        raise ValueError(f"unknown parameters kind {kind!r}")
    return SamplingParams(**fields)  # a structured_outputs dict becomes StructuredOutputsParams


# ---------------------------------------------------------------------------- stats, timings

# Field names read once: ``dataclasses.fields`` rebuilds its tuple at every call, and a timing
# is encoded for every request in every step.
_STATS_FIELDS = [f.name for f in dataclasses.fields(EngineStats)]
_TIMING_FIELDS = [f.name for f in dataclasses.fields(RequestTiming)]


def encode_stats(stats: EngineStats) -> list:
    return [getattr(stats, name) for name in _STATS_FIELDS]


def decode_stats(data: list) -> EngineStats:
    stats = EngineStats(*data)
    return dataclasses.replace(stats, spec_accepted_per_position=tuple(stats.spec_accepted_per_position))


def encode_timing(timing: RequestTiming) -> list:
    return [getattr(timing, name) for name in _TIMING_FIELDS]


def decode_timing(data: list) -> RequestTiming:
    return RequestTiming(*data)


# ---------------------------------------------------------------------------- outputs

# Every field by position, so a field added to a delta crosses the process with no edit here.
_DELTA_FIELDS = [f.name for f in dataclasses.fields(OutputDelta) if f.name != "sequences"]
_SEQUENCE_FIELDS = [f.name for f in dataclasses.fields(SequenceDelta)]


def encode_delta(delta: OutputDelta) -> list:
    seqs = [[getattr(s, name) for name in _SEQUENCE_FIELDS] for s in delta.sequences]
    return [seqs, *(getattr(delta, name) for name in _DELTA_FIELDS)]


def decode_delta(data: list) -> OutputDelta:
    seqs, *values = data
    return OutputDelta(sequences=[SequenceDelta(*s) for s in seqs], **dict(zip(_DELTA_FIELDS, values)))


# ---------------------------------------------------------------------------- errors

def encode_error(error: BaseException) -> list:
    if isinstance(error, ContextLengthError):  # its numbers, so the server can word it for chat
        return ["ContextLengthError", str(error), *error.numbers, error.param]
    if isinstance(error, InputError):  # bad input keeps the field it names
        return ["InputError", str(error), error.param]
    return [type(error).__name__, str(error)]


class EngineCoreError(RuntimeError):
    """An error raised in the engine-core process whose type has no counterpart here."""


def decode_error(data: list) -> Exception:
    """The error as the server would have seen it in-process: built-in exception types (a
    ``ValueError`` for bad input) and the model loader's ``ModelLoadError`` keep their type, so
    the HTTP mapping and the CLI's one-line user errors work the same; others keep their
    type's name in the message."""
    name, message = data[:2]
    if name == "InputError":
        return InputError(message, data[2])
    if name == "ContextLengthError":
        return ContextLengthError(*data[2:])
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, Exception):
        return kind(message)
    if name == "ModelLoadError":
        from ..models.loader import ModelLoadError
        return ModelLoadError(message)
    return EngineCoreError(f"{name}: {message}")


# ---------------------------------------------------------------------------- readiness facts

@dataclass(frozen=True)
class EngineFacts:
    """What the server needs to know about the engine once it is built (sent with ``ready``)."""

    model_path: str  # the model as configured (what /v1/models reports)
    tokenizer_path: str  # where the server loads its own copy of the tokenizer from
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    eos_token_ids: list[int]
    stats: EngineStats

    def encode(self) -> dict[str, Any]:
        return {**{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "stats"},
                "stats": encode_stats(self.stats)}

    @classmethod
    def decode(cls, data: dict[str, Any]) -> "EngineFacts":
        return cls(**{**data, "stats": decode_stats(data["stats"])})
