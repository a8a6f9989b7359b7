"""What one request may ask of the server, checked before any of it is tokenized or queued.

Each limit bounds the cost a single request can impose (tokenizer time, memory, engine work
per step), so that one hostile or careless request cannot stall or starve the others. Every
refusal is a 400 that names the limit, its flag and the offending field (``param``). The
values come from ``ServerSettings`` (one ``--flag`` each); the prompt limits default to values
derived from the engine's ``max_model_len``, read once the engine is ready.

- prompt characters: ``max_model_len * CHARS_PER_TOKEN`` unless ``--max-prompt-chars`` is set.
  Refused before tokenizing: tokenizing costs time linear in the text (the demo model's
  tokenizer took 64 s for a 15 MB prompt), and a prompt that long could never fit anyway.
- prompt tokens: ``max_model_len - 1`` (a prompt must leave room for one generated token), or
  ``--max-prompt-tokens`` when lower. Token-id prompts are checked before they are queued;
  text prompts right after tokenizing, one at a time, so the first too-long prompt of a batch
  stops the work.
- prompts per request, sequences (prompts x n) per request, messages per chat request, stop
  strings (count and length) and stop token ids per request.
- ``/detokenize`` takes at most ``max_model_len`` ids: no sequence is longer.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

from .errors import APIError, bad_request

if TYPE_CHECKING:
    from .state import ServerSettings

# Characters per token of context that a prompt may have before it is refused untokenized.
# English text averages about 4 characters per token and the longest tokens of common
# vocabularies about 16, so a prompt with 32 characters per token of max_model_len would need
# tokens twice the length of the longest ones to fit: in practice it is always too long, and
# refusing it early saves the tokenizer's time. Text that a vocabulary merges into unusually
# long tokens (long runs of spaces or of one symbol) is the exception: raise
# --max-prompt-chars for such workloads.
CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class Limits:
    """The limits in force, with the defaults that depend on the model resolved."""

    max_model_len: int
    prompt_chars: int
    prompt_tokens: int
    prompts: int
    sequences: int
    messages: int
    stop_strings: int
    stop_string_chars: int
    stop_token_ids: int

    @classmethod
    def resolve(cls, settings: "ServerSettings", max_model_len: int) -> "Limits":
        room = max(max_model_len - 1, 0)
        tokens = room if settings.max_prompt_tokens is None else min(settings.max_prompt_tokens, room)
        chars = settings.max_prompt_chars or max_model_len * CHARS_PER_TOKEN
        return cls(max_model_len=max_model_len, prompt_chars=chars, prompt_tokens=tokens,
                   prompts=settings.max_prompts_per_request, sequences=settings.max_sequences_per_request,
                   messages=settings.max_messages, stop_strings=settings.max_stop_strings,
                   stop_string_chars=settings.max_stop_string_chars, stop_token_ids=settings.max_stop_token_ids)

    # ------------------------------------------------------------------ the checks

    def check_stops(self, stop: Sequence[str], stop_token_ids: Optional[Sequence[int]]) -> None:
        """Stop strings are matched against the text at every step, and stop ids per token."""
        if len(stop) > self.stop_strings:
            raise _refuse(f"stop has {len(stop)} strings; at most {self.stop_strings} are allowed",
                          "--max-stop-strings", "stop", "too_many_stop_strings")
        for i, text in enumerate(stop):
            if len(text) > self.stop_string_chars:
                raise _refuse(f"stop[{i}] has {len(text)} characters; at most {self.stop_string_chars} "
                              "are allowed", "--max-stop-string-chars", "stop", "stop_string_too_long")
        if stop_token_ids is not None and len(stop_token_ids) > self.stop_token_ids:
            raise _refuse(f"stop_token_ids has {len(stop_token_ids)} ids; at most {self.stop_token_ids} "
                          "are allowed", "--max-stop-token-ids", "stop_token_ids", "too_many_stop_token_ids")

    def check_prompts(self, prompts: Sequence[Union[str, list[int]]], n: int) -> None:
        """The number of prompts and sequences, and each prompt's characters or token ids."""
        if len(prompts) > self.prompts:
            raise _refuse(f"prompt holds {len(prompts)} prompts; at most {self.prompts} are allowed per "
                          "request", "--max-prompts-per-request", "prompt", "too_many_prompts")
        self.check_sequences(len(prompts), n, "prompt")
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self.check_chars(len(prompt), _name(i, len(prompts)), "prompt")
            else:
                self.check_tokens(len(prompt), _name(i, len(prompts)), "prompt")

    def check_sequences(self, num_prompts: int, n: int, prompt_param: str) -> None:
        if num_prompts * n > self.sequences:
            raise _refuse(f"this request asks for {num_prompts} prompt(s) x n={n} = {num_prompts * n} "
                          f"sequences; at most {self.sequences} are allowed per request",
                          "--max-sequences-per-request", "n" if n > 1 else prompt_param, "too_many_sequences")

    def check_messages(self, num_messages: int, n: int, param: str = "messages") -> None:
        """``param``: the field the messages came from (``/v1/responses`` builds them from ``input``)."""
        if num_messages > self.messages:
            raise _refuse(f"{param} holds {num_messages} messages; at most {self.messages} are allowed",
                          "--max-messages", param, "too_many_messages")
        self.check_sequences(1, n, param)

    def check_message_chars(self, messages: Sequence[dict[str, Any]], param: str = "messages") -> None:
        """The messages' text together against the prompt's character limit."""
        chars = sum(len(m.get("content") or "") + len(m.get("name") or "") for m in messages)
        self.check_chars(chars, "the messages' text", param)

    def check_chars(self, chars: int, what: str, param: str) -> None:
        if chars > self.prompt_chars:
            raise _refuse(f"{what} has {chars} characters; at most {self.prompt_chars} are allowed (by default "
                          f"{CHARS_PER_TOKEN} per token of max_model_len {self.max_model_len})",
                          "--max-prompt-chars", param, "prompt_too_long")

    def check_tokens(self, tokens: int, what: str, param: str) -> None:
        """Against --max-prompt-tokens; a prompt that also fills the context is refused in
        OpenAI's words (see ContextLengthError), which clients recognise as an overflow."""
        if tokens > self.prompt_tokens and tokens >= self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, {what} "
                              f"has {tokens} tokens, which leaves no room for a completion. Please reduce the "
                              f"length of {what}.", param, code="context_length_exceeded")
        if tokens > self.prompt_tokens:
            raise _refuse(f"{what} has {tokens} tokens; at most {self.prompt_tokens} are allowed "
                          f"(max_model_len is {self.max_model_len}, and a prompt must leave room for at least "
                          "one generated token)", "--max-prompt-tokens", param, "prompt_too_long")

    def check_detokenize(self, num_tokens: int) -> None:
        if num_tokens > self.max_model_len:
            raise bad_request(f"tokens has {num_tokens} ids; at most {self.max_model_len} (max_model_len) "
                              "can be detokenized at once", "tokens", code="too_many_tokens")


def _name(index: int, count: int) -> str:
    return "the prompt" if count == 1 else f"prompt {index}"


def _refuse(message: str, flag: str, param: str, code: str) -> APIError:
    return bad_request(f"{message} ({flag})", param, code=code)
