"""The HTTP layer's tokenizer: small inputs on the event loop, large ones on a worker thread.

Why: tokenizing is linear in the text and runs in the caller's thread; a large prompt encoded
on the event loop held every other connection (``/health``, other streams) for as long as it
took. Small inputs stay on the loop, where a thread hop would cost more than the work; inputs
over ``INLINE_CHARS`` characters or ``INLINE_TOKENS`` ids go to one worker thread. The Rust
encoder releases the GIL, so the loop keeps serving while it works.

Why two tokenizer copies: a Rust-backed tokenizer must not be used by two threads at once
(PyO3 borrow checks), so the loop's copy and the worker's copy are distinct objects (both
made by ``EngineClient`` when its engine is ready), each used by one thread only.

Failures stay with their request: a tokenizer that rejects its input (``TypeError``,
``ValueError``, ``OverflowError``) is a 400; anything else is logged in one line (``errors.log_failure``) and
answered with a 500, and the next request finds the tokenizer as before.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

from .errors import APIError, bad_request, internal_error

INLINE_CHARS = 1024
INLINE_TOKENS = 4096

T = TypeVar("T")


class ServerTokenizer:
    """Encodes, decodes and renders chat templates for routes, each call on the right thread."""

    def __init__(self, loop_tokenizer: Any, worker_tokenizer: Any) -> None:
        self.loop_tokenizer = loop_tokenizer  # also used directly by TokenTexts (one id at a time)
        self._worker_tokenizer = worker_tokenizer
        self._executor: Optional[ThreadPoolExecutor] = None

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[[Any], T], size: int, inline_limit: int, what: str, param: Optional[str]) -> T:
        """``fn(tokenizer)`` on the loop when ``size <= inline_limit``, else on the worker thread;
        an exception from the tokenizer becomes the request's 400 or 500 (``APIError``s pass)."""
        if size <= inline_limit:
            return _guarded(fn, self.loop_tokenizer, what, param)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="vgraph-tokenizer")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _guarded, fn, self._worker_tokenizer, what, param)

    async def encode(self, text: str, add_special_tokens: bool = True, param: Optional[str] = "prompt") -> list[int]:
        return await self.run(lambda tok: list(tok.encode(text, add_special_tokens=add_special_tokens)),
                              len(text), INLINE_CHARS, "encode the prompt", param)

    async def encode_prompts(self, prompts: list[Any], check: Callable[[int, list[int]], None]) -> list[list[int]]:
        """Token ids for each prompt (text is encoded as the engine would: special tokens
        added), each passed to ``check(index, ids)`` as soon as it exists, so a too-long
        prompt stops the batch before the rest is tokenized."""
        def encode_all(tok: Any) -> list[list[int]]:
            out = []
            for i, prompt in enumerate(prompts):
                ids = list(tok.encode(prompt)) if isinstance(prompt, str) else prompt
                check(i, ids)
                out.append(ids)
            return out

        chars = sum(len(p) for p in prompts if isinstance(p, str))
        return await self.run(encode_all, chars, INLINE_CHARS, "encode the prompt", "prompt")

    async def decode(self, ids: list[int], param: Optional[str] = "tokens") -> str:
        def decode(tok: Any) -> str:
            return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

        return await self.run(decode, len(ids), INLINE_TOKENS, "decode the tokens", param)

    async def render_chat(self, messages: list[dict[str, Any]], template: Optional[str],
                          add_generation_prompt: bool,
                          tools: Optional[list[dict[str, Any]]] = None) -> tuple[str, list[int]]:
        """The chat template's text for ``messages`` (and ``tools``, for templates that take
        them) and its token ids (no special tokens added: the template writes them)."""
        def render(tok: Any) -> tuple[str, list[int]]:
            try:
                text = tok.apply_chat_template(messages, tokenize=False, chat_template=template,
                                               add_generation_prompt=add_generation_prompt, tools=tools)
            except Exception as exc:  # template errors (raise_exception, bad roles) are the caller's
                raise bad_request(f"the chat template failed on these messages: {exc}", "messages") from None
            return text, list(tok.encode(text, add_special_tokens=False))

        chars = sum(len(m.get("content") or "") for m in messages)
        return await self.run(render, chars, INLINE_CHARS, "encode the messages", "messages")


def _guarded(fn: Callable[[Any], T], tokenizer: Any, what: str, param: Optional[str]) -> T:
    try:
        return fn(tokenizer)
    except APIError:
        raise
    except (TypeError, ValueError, OverflowError) as exc:  # what a binding raises for bad arguments
        raise bad_request(f"the tokenizer could not {what}: {type(exc).__name__}: {exc}", param,
                          code="tokenizer_error") from None
    except Exception as exc:
        raise internal_error(f"the tokenizer failed to {what}", exc) from None
