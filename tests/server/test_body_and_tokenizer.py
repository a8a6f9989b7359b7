"""In process, no server: the body checks (depth, UTF-8, surrogates), the tokenizer's threads
and error mapping, and the one-line failure log."""
from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest

from vgraph.server.body import nested_deeper_than, parse_json_object
from vgraph.server.errors import APIError, log_failure
from vgraph.server.limits import Limits
from vgraph.server.state import ServerSettings
from vgraph.server.tokenization import INLINE_CHARS, ServerTokenizer


@pytest.mark.parametrize("body,limit,deeper", [
    (b'{"a": 1}', 1, False),
    (b'{"a": [1]}', 1, True),
    (b"[" * 64 + b"]" * 64, 64, False),
    (b"[" * 65 + b"]" * 65, 64, True),
    (b"[" * 100_000 + b"]" * 100_000, 64, True),
    (b'{"p": "' + b"[" * 1000 + b'"}', 64, False),                 # brackets in a string do not count
    (b'{"p": "\\"' + b"{" * 1000 + b'\\""}', 64, False),           # nor after an escaped quote
    (b'{"p": "\\\\", "q": ' + b"[" * 70 + b"]" * 70 + b"}", 64, True),  # an escaped backslash ends no string
    (b"[[]]" * 10_000, 2, False),                                  # many brackets, shallow
])
def test_the_depth_scan(body, limit, deeper):
    assert nested_deeper_than(body, limit) is deeper


@pytest.mark.parametrize("body,param,where", [
    (b'{"prompt": "a\\ud800"}', "prompt", "prompt"),
    (b'{"prompt": "a\xed\xa0\x80"}', "prompt", "prompt"),
    (b'{"prompt": ["fine", "\\uDFFF"]}', "prompt", "prompt[1]"),
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}', "messages",
     "messages[0].content[0].text"),
    (b'{"stop": ["\xed\xbf\xbf"]}', "stop", "stop[0]"),
    (b'{"\\ud800": 1}', None, "a key of the body"),
    (b'{"prompt": "\xed\xa0\xbd\xed\xb8\x80"}', "prompt", "prompt"),  # a pair encoded as two surrogates
])
def test_lone_surrogates_are_refused_naming_the_field(body, param, where):
    with pytest.raises(APIError) as err:
        parse_json_object(body, 64)
    assert err.value.status == 400 and err.value.code == "invalid_unicode" and err.value.param == param
    assert err.value.message.startswith(where) and "surrogate" in err.value.message


def test_well_formed_text_passes():
    text = "emoji \U0001f600, accents \u00e9, an escaped backslash-u: \\ud800"
    assert parse_json_object(json.dumps({"prompt": text}).encode(), 64) == {"prompt": text}
    assert parse_json_object(b'{"p": "\\ud83d\\ude00"}', 64) == {"p": "\U0001f600"}  # an escaped pair
    assert parse_json_object(b'\xef\xbb\xbf{"a": 1}', 64) == {"a": 1}  # a UTF-8 byte order mark


@pytest.mark.parametrize("body,words", [
    (b"caf\xe9", "not UTF-8"),
    ('{"a": 1}'.encode("utf-16"), "not UTF-8"),
    (b'{"a": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested more than 64"),
    (b"[1]", "JSON object"),
])
def test_other_bad_bodies(body, words):
    with pytest.raises(APIError) as err:
        parse_json_object(body, 64)
    assert err.value.status == 400 and words in err.value.message


class _RecordingTokenizer:
    """Records which thread each call ran on; raises what ``fail_with`` says."""

    def __init__(self, fail_with: BaseException | None = None) -> None:
        self.threads: list[str] = []
        self.fail_with = fail_with

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if self.fail_with is not None:
            raise self.fail_with
        return [len(text)]

    def decode(self, ids: list[int], **_: object) -> str:
        self.threads.append(threading.current_thread().name)
        return "x" * len(ids)


def test_large_inputs_are_tokenized_off_the_event_loop():
    loop_copy, worker_copy = _RecordingTokenizer(), _RecordingTokenizer()
    tokenizer = ServerTokenizer(loop_copy, worker_copy)

    async def main() -> None:
        try:
            assert await tokenizer.encode("short") == [5]
            assert await tokenizer.encode("x" * (INLINE_CHARS + 1)) == [INLINE_CHARS + 1]
            encoded = await tokenizer.encode_prompts(["a" * 5000, [1, 2], "b"], lambda i, ids: None)
            assert encoded == [[5000], [1, 2], [1]]
            assert await tokenizer.decode(list(range(100_000))) == "x" * 100_000
        finally:
            tokenizer.close()

    asyncio.run(main())
    assert loop_copy.threads == ["MainThread"]
    assert len(worker_copy.threads) == 4 and all(t.startswith("vgraph-tokenizer") for t in worker_copy.threads)


def test_a_check_stops_a_batch_at_the_first_bad_prompt():
    tok = _RecordingTokenizer()
    tokenizer = ServerTokenizer(tok, tok)

    def check(i: int, ids: list[int]) -> None:
        if ids[0] > 3:
            raise APIError(400, f"prompt {i} is too long", param="prompt")

    with pytest.raises(APIError, match="prompt 1"):
        asyncio.run(tokenizer.encode_prompts(["abc", "abcdef", "abc"], check))
    assert len(tok.threads) == 2  # the third prompt was never tokenized


@pytest.mark.parametrize("failure,status", [(TypeError("TextEncodeInput must be ..."), 400),
                                            (ValueError("bad"), 400), (RuntimeError("borrowed"), 500)])
def test_tokenizer_failures_become_400_or_a_logged_500(failure, status, caplog):
    tokenizer = ServerTokenizer(_RecordingTokenizer(failure), _RecordingTokenizer(failure))
    with caplog.at_level(logging.INFO, logger="vgraph.server"), pytest.raises(APIError) as err:
        asyncio.run(tokenizer.encode("hi"))
    assert err.value.status == status and type(failure).__name__ in err.value.message
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == (1 if status == 500 else 0)
    assert all(r.exc_info is None for r in errors), "no traceback at ERROR level"


def test_a_repeated_failure_logs_its_traceback_once_at_debug(caplog):
    def fail() -> None:
        raise KeyError("always the same bug")

    with caplog.at_level(logging.DEBUG, logger="vgraph.server"):
        for _ in range(3):
            try:
                fail()
            except KeyError as exc:
                log_failure("a request failed", exc)
    assert [r.levelno for r in caplog.records].count(logging.ERROR) == 3
    assert len([r for r in caplog.records if r.exc_info is not None and r.levelno == logging.DEBUG]) == 1


def test_limits_derive_from_max_model_len_and_settings():
    limits = Limits.resolve(ServerSettings(["m"]), 512)
    assert (limits.prompt_chars, limits.prompt_tokens) == (512 * 32, 511)
    tighter = Limits.resolve(ServerSettings(["m"], max_prompt_chars=100, max_prompt_tokens=10_000), 512)
    assert (tighter.prompt_chars, tighter.prompt_tokens) == (100, 511)  # tokens never above max_model_len - 1
    with pytest.raises(ValueError, match="max_stop_strings"):
        ServerSettings(["m"], max_stop_strings=0)
