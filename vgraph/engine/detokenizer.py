"""Incremental detokenization and stop-string detection for one sequence.

Decoding the whole output every step is quadratic, and decoding each new token alone is wrong:
byte-level BPE tokens can hold part of a UTF-8 character, and SentencePiece-style decoders
treat a sequence's first token differently (leading-space handling). So this keeps two offsets
into the token ids, as vLLM does:

- ``prefix_offset``: start of a few already-emitted tokens decoded again as context;
- ``read_offset``: end of the tokens whose text has been emitted.

Each step decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``; the new text
is the difference. If the longer decode ends in U+FFFD the last token is an incomplete UTF-8
sequence, so nothing is emitted and the offsets stay put until the character completes.
Decoding goes through ``tokenizer.decode`` (with ``clean_up_tokenization_spaces=False``, so
the pieces concatenate), which works for any Hugging Face tokenizer, special/added tokens
included. For a fast tokenizer whose class keeps the base class's ``decode``, that call is
exactly the Rust tokenizer's own ``decode``, and the same two offsets are kept in Rust by the
``tokenizers`` library's ``DecodeStream`` (seeded with the prompt's context): one call per
token instead of two decodes and two list slices, 0.6 against 1.5 us a token, which is paid
for every running sequence in every step (a quarter of a millisecond of host time per step at
batch 256). Should the stream refuse a step (its decoded text no longer extends the previous
one), the sequence goes on in Python from the last token whose text was emitted.

The text therefore equals ``tokenizer.decode(output_ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)``, except that the prompt's last tokens serve as context
for the first output token (e.g. its leading space is kept, as in vLLM), and that bytes of a
character the output never completes stay held back (no trailing U+FFFD).

Stop strings are found with one regular expression (the strings escaped, in the caller's
order) searched only over the text added by the latest update plus the longest stop string's
length of lookback: the older text had no match, so an update costs the same however long
the output already is and however many stop strings there are.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:
    from ..core.request import Request

_REPLACEMENT_CHAR = "\ufffd"
# How many prompt tokens to keep as decoding context for the first output token (vLLM's value).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Builds ``output_text`` token by token and cuts it at the first stop string.

    ``output_text`` is the text so far (after any stop-string truncation). ``sent_offset`` is
    how many of its characters ``get_delta_text`` has already handed out for streaming.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True,
                 stop: Optional[Sequence[str]] = None, include_stop_str_in_output: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        context = list(prompt_token_ids)[-_PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context  # prompt context + every output token
        self._num_context = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.output_text = ""
        self.sent_offset = 0
        self.stop_reason: Optional[str] = None
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self._stop_pattern = _stop_pattern(self.stop)
        backend = _rust_tokenizer(tokenizer)
        self._decode_ids = _decoder(tokenizer, backend, skip_special_tokens)
        self._stream = None if backend is None else _decode_stream(backend, context, skip_special_tokens)

    @classmethod
    def from_request(cls, tokenizer: Any, request: "Request") -> "IncrementalDetokenizer":
        """Takes the stop strings and special-token handling from the request's SamplingParams."""
        params = request.sampling_params
        return cls(tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                   stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context:]

    @property
    def finished(self) -> bool:
        """True once a stop string has matched; later updates add tokens but no text."""
        return self.stop_reason is not None

    def update(self, new_token_ids: Sequence[int]) -> Optional[str]:
        """Appends tokens, extends ``output_text``; returns the stop string if one now matched."""
        if self.stop_reason is not None:  # finished
            self._ids.extend(new_token_ids)
            return None
        previous_len = len(self.output_text)
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self.output_text += self._stream_step(token_id) if self._stream is not None else self._decode_step()
        return None if self._stop_pattern is None else self._check_stop(previous_len)

    def get_delta_text(self, finished: bool = False) -> str:
        """Text not streamed yet, marking it sent.

        While the sequence runs, the last ``max stop length - 1`` characters are withheld
        because they could be the start of a stop string that must not reach the client. Once
        finished (a stop string matched, or the caller says so) everything left is released.
        """
        end = len(self.output_text)
        if not (finished or self.finished or self.include_stop_str_in_output):
            end = max(self.sent_offset, end - max(self._max_stop_len - 1, 0))
        delta = self.output_text[self.sent_offset:end]
        self.sent_offset = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids)

    def _decode_step(self) -> str:
        """Text completed by the latest token; '' while a UTF-8 character is still partial."""
        prefix_text = self._decode(self._ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self._ids[self.prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _stream_step(self, token_id: int) -> str:
        """``_decode_step`` done by the Rust stream; the offsets follow it so the Python path
        can take over where it stopped."""
        stream, backend = self._stream
        try:
            piece = stream.step(backend, token_id)
        except Exception:  # the stream's prefix check failed: decode in Python from here on
            self._stream = None
            return self._decode_step()
        if piece is None:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        return piece

    def _check_stop(self, previous_len: int) -> Optional[str]:
        """Finds the earliest stop string that ends in the new text and truncates there.

        A match must overlap the new text (the old text had none), so the search starts
        ``max stop length - 1`` characters before it. Earliest start wins; on a tie, the first
        listed (a regex alternation tries its branches in order at each position).
        """
        if self._stop_pattern is None or len(self.output_text) == previous_len:
            return None
        start = max(0, previous_len - self._max_stop_len + 1)
        match = self._stop_pattern.search(self.output_text, start)
        if match is None:
            return None
        stop = match.group()
        cut = match.end() if self.include_stop_str_in_output else match.start()
        self.output_text = self.output_text[:cut]
        self.sent_offset = min(self.sent_offset, cut)
        self.stop_reason = stop
        return stop


def _rust_tokenizer(tokenizer: Any) -> Optional[Any]:
    """The Rust tokenizer behind ``tokenizer`` where ``tokenizer.decode(ids, skip_special_tokens=...,
    clean_up_tokenization_spaces=False)`` is all a call to it; None for a slow tokenizer or a
    subclass that overrides either decode (it keeps its wrapper)."""
    try:
        from transformers import PreTrainedTokenizerFast as fast
    except ImportError:  # a transformers without fast tokenizers: the wrapper serves
        return None
    cls = type(tokenizer)
    if isinstance(tokenizer, fast) and cls.decode is fast.decode and cls._decode is fast._decode:
        return tokenizer.backend_tokenizer
    return None


def _decoder(tokenizer: Any, backend: Optional[Any], skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode`` returns it: the Rust ``backend``'s own decode
    where there is one (``_rust_tokenizer``), else the wrapper."""
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


def _decode_stream(backend: Any, context: list[int], skip_special_tokens: bool) -> Optional[tuple[Any, Any]]:
    """A ``tokenizers.decoders.DecodeStream`` seeded with ``context`` and the Rust tokenizer it
    decodes with; None with a ``tokenizers`` that has no seedable stream (before 0.22)."""
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    if backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(_REPLACEMENT_CHAR):
        return None  # the stream would emit the context's text with the first token
    try:
        stream = DecodeStream(list(context), skip_special_tokens=skip_special_tokens)
    except TypeError:
        return None
    return stream, backend


def _stop_pattern(stops: Sequence[str]) -> Optional[re.Pattern[str]]:
    """One alternation of the escaped stop strings, in the caller's order; None without any."""
    if not stops:
        return None
    return re.compile("|".join(re.escape(s) for s in stops))
