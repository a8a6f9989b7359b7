"""IncrementalDetokenizer on a small byte-level BPE trained here: text, UTF-8 hold-back, stop strings."""
from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from vgraph.core.request import Request
from vgraph.engine.detokenizer import IncrementalDetokenizer
from vgraph.sampling_params import SamplingParams

CORPUS = ["héllo wörld 日本", "the quick brown fox jumps over the lazy dog",
          "hello world, hello there", "naïve café déjà vu"]
TEXTS = ["héllo wörld 日本語 STOP here", "the lazy café fox 日本 jumps", "über 🙂 smile 日"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """Small vocab so non-ASCII characters split across byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 3, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _feed(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], list[str], str]:
    """One token per update; returns the text after each step, streamed deltas, and the stop."""
    texts, deltas, stop = [], [], None
    for token_id in ids:
        stop = detok.update([token_id])
        texts.append(detok.output_text)
        deltas.append(detok.get_delta_text())
        if stop is not None:
            break
    deltas.append(detok.get_delta_text(finished=True))
    return texts, deltas, stop


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hello world"), skip_special_tokens=True)
    texts, deltas, stop = _feed(detok, ids + [tokenizer.eos_token_id])
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == text
    assert "".join(deltas) == text
    assert all("\ufffd" not in t for t in texts)
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # text only ever grows


def test_special_tokens_kept_when_asked(tokenizer):
    ids = tokenizer.encode("hello") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    _feed(detok, ids)
    assert detok.output_text == "hello</s>"


def test_partial_multibyte_is_held_back(tokenizer):
    ids = tokenizer.encode("日本")
    assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids), "tokenizer should split the bytes"
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    texts, _, _ = _feed(detok, ids)
    assert texts[0] == "" and texts[-1] == "日本"
    assert all("日本".startswith(text) for text in texts)  # never a replacement char


def test_multi_token_update_matches_single_steps(tokenizer):
    ids = tokenizer.encode(TEXTS[0])
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    for start in range(0, len(ids), 3):
        detok.update(ids[start:start + 3])
    assert detok.output_text == TEXTS[0]
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("stop, include, expected", [
    ("STOP", False, "héllo wörld 日本語 "),
    ("STOP", True, "héllo wörld 日本語 STOP"),
    ("ld 日", False, "héllo wör"),  # spans a word token and a partial-byte token
    ("ld 日", True, "héllo wörld 日"),
    ("llo", False, "hé"),  # inside a single token
    ("O", True, "héllo wörld 日本語 STO"),
])
def test_stop_strings_cut_exactly(tokenizer, stop, include, expected):
    ids = tokenizer.encode(TEXTS[0])
    detok = IncrementalDetokenizer(tokenizer, [], stop=[stop], include_stop_str_in_output=include)
    texts, deltas, matched = _feed(detok, ids)
    assert matched == stop and detok.stop_reason == stop and detok.finished
    assert detok.output_text == expected
    assert "".join(deltas) == expected  # streaming never sent anything past the cut


def test_earliest_stop_wins_and_later_updates_add_no_text(tokenizer):
    ids = tokenizer.encode(TEXTS[0])
    detok = IncrementalDetokenizer(tokenizer, [], stop=["here", "wör", "STOP"])
    matched = detok.update(ids)
    assert matched == "wör" and detok.output_text == "héllo "
    assert detok.update(tokenizer.encode(" more")) is None
    assert detok.output_text == "héllo "


def test_streaming_withholds_possible_stop_prefix(tokenizer):
    ids = tokenizer.encode(TEXTS[1])
    detok = IncrementalDetokenizer(tokenizer, [], stop=["zzzz", "xy"])
    sent = ""
    for token_id in ids:
        assert detok.update([token_id]) is None
        sent += detok.get_delta_text()
        assert detok.output_text.startswith(sent)
        assert len(detok.output_text) - len(sent) <= 3  # longest stop length - 1
    assert sent + detok.get_delta_text(finished=True) == TEXTS[1]


def test_from_request_takes_sampling_params(tokenizer):
    params = SamplingParams(stop="fox", include_stop_str_in_output=True, skip_special_tokens=False)
    request = Request(request_id="r", prompt_token_ids=tokenizer.encode("the"), sampling_params=params)
    detok = IncrementalDetokenizer.from_request(tokenizer, request)
    assert detok.update(tokenizer.encode(" lazy fox jumps")) == "fox"
    assert detok.output_text == " lazy fox"


# ---------------------------------------------------------------- multi-byte characters split across tokens

MULTIBYTE = ["日本語 🙂 ok", "é🙂日", "🙂🙂 über 日本", "a\u00e9\u4e2d\U0001f600z"]


def _byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet's single-byte tokens): every multi-byte
    character is split, as a model may emit it."""
    byte_chars = _bytes_to_unicode()
    return tokenizer.convert_tokens_to_ids([byte_chars[b] for b in text.encode("utf-8")])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which the ByteLevel pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _mixed_token_ids(tokenizer, text: str, seed: int) -> list[int]:
    """Words tokenized normally, some characters as single-byte tokens, chosen by ``seed``."""
    import random
    rng, ids = random.Random(seed), []
    for ch in text:
        ids += _byte_token_ids(tokenizer, ch) if rng.random() < 0.5 else tokenizer.encode(ch)
    return ids


@pytest.mark.parametrize("text", MULTIBYTE)
@pytest.mark.parametrize("split", ["bytes", "mixed0", "mixed1"])
def test_split_characters_never_show_a_replacement_char(tokenizer, text, split):
    ids = _byte_token_ids(tokenizer, text) if split == "bytes" else _mixed_token_ids(tokenizer, text, int(split[-1]))
    assert tokenizer.decode(ids) == text
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "some token must hold a partial character"
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hello"), skip_special_tokens=True)
    texts, deltas, _ = _feed(detok, ids)
    assert all("\ufffd" not in t and text.startswith(t) for t in texts), texts
    assert all("\ufffd" not in d for d in deltas) and "".join(deltas) == text == detok.output_text


def test_a_character_completed_in_a_multi_token_update(tokenizer):
    """Several tokens in one update (a partial character completed inside it) give the same text."""
    ids = _byte_token_ids(tokenizer, "🙂日")
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.update(ids[:2])
    assert detok.output_text == ""
    detok.update(ids[2:5])  # completes 🙂, starts 日
    assert detok.output_text == "🙂"
    detok.update(ids[5:])
    assert detok.output_text == "🙂日"


def test_stop_string_made_of_split_bytes(tokenizer):
    ids = _byte_token_ids(tokenizer, "ab🙂cd")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["🙂"])
    texts, deltas, matched = _feed(detok, ids)
    assert matched == "🙂" and detok.output_text == "ab" and "".join(deltas) == "ab"
    assert all("\ufffd" not in t for t in texts)


# ---------------------------------------------------------------- many stop strings, long outputs

def _reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Brute force: the earliest stop occurrence (first listed on a tie) over the whole text."""
    found = [(text.find(s), i, s) for i, s in enumerate(stops) if s and s in text]
    if not found:
        return text, None
    index, _, stop = min(found)
    return text[:index], stop


@pytest.mark.parametrize("seed", range(4))
def test_many_stop_strings_match_the_brute_force_answer(tokenizer, seed):
    import random
    rng = random.Random(seed)
    words = ["the", "lazy", "café", "fox", "日本", "jumps", " ", "héllo", "🙂"]
    text = "".join(rng.choice(words) for _ in range(200))
    stops = ["".join(rng.choice(words) for _ in range(rng.randint(1, 3))) for _ in range(64)]
    stops = [s for s in stops if text.count(s) < 2][:64] + ["xyz" * 5]  # some match late, some never
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
    _feed(detok, tokenizer.encode(text))
    expected_text, expected_stop = _reference_stop(text, stops)
    assert (detok.output_text, detok.stop_reason) == (expected_text, expected_stop)


class _RecordingPattern:
    """Wraps the compiled stop pattern, recording how many characters each search may scan."""

    def __init__(self, pattern) -> None:
        self.pattern, self.scanned = pattern, []

    def search(self, text: str, pos: int = 0):
        self.scanned.append(len(text) - pos)
        return self.pattern.search(text, pos)


def test_stop_search_scans_only_new_text_plus_lookback(tokenizer):
    """64 stop strings that never match, a long output: each update searches the text it added
    plus (longest stop - 1) characters, never the whole output again (which is quadratic)."""
    stops = [f"<never {i:02d}>" for i in range(64)]
    detok = IncrementalDetokenizer(tokenizer, [], stop=stops)
    detok._stop_pattern = recorder = _RecordingPattern(detok._stop_pattern)
    ids = tokenizer.encode(" ".join(TEXTS) * 40)
    added = []
    for token_id in ids:
        before = len(detok.output_text)
        assert detok.update([token_id]) is None
        added.append(len(detok.output_text) - before)
    longest = max(map(len, stops))
    assert len(detok.output_text) > 50 * longest
    assert recorder.scanned == [n + min(longest - 1, done) for n, done in
                                zip(added, _running_totals(added)) if n]


def _running_totals(values: list[int]) -> list[int]:
    """Text length before each update."""
    totals, total = [], 0
    for v in values:
        totals.append(total)
        total += v
    return totals


class _OwnDecode(PreTrainedTokenizerFast):
    """A tokenizer class with its own ``_decode``: it must keep going through the wrapper."""

    def _decode(self, token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=None, **kwargs):
        return "<" + super()._decode(token_ids, skip_special_tokens, clean_up_tokenization_spaces, **kwargs) + ">"


@pytest.mark.parametrize("skip", [True, False])
def test_direct_decoding_equals_the_wrapper(tokenizer, skip, monkeypatch):
    """The Rust tokenizer is called directly for a plain fast tokenizer (the wrapper is never
    called); every id alone and every window of a text with special tokens decodes as
    tokenizer.decode does."""
    ids = [tokenizer.bos_token_id] + tokenizer.encode("héllo wörld 日本語 the café") + [tokenizer.eos_token_id]
    windows = [[i] for i in range(len(tokenizer))] + [ids[a:b] for a in range(len(ids)) for b in range(a, len(ids) + 1)]
    expected = [tokenizer.decode(w, skip_special_tokens=skip, clean_up_tokenization_spaces=False) for w in windows]

    def wrapper_called(*args, **kwargs):
        raise AssertionError("decoded through the Python wrapper")
    monkeypatch.setattr(tokenizer, "decode", wrapper_called)
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
    assert [detok._decode(w) for w in windows] == expected


def test_a_tokenizer_with_its_own_decode_keeps_it(tokenizer):
    own = _OwnDecode(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<s>", eos_token="</s>")
    detok = IncrementalDetokenizer(own, [], skip_special_tokens=True)
    ids = own.encode("hello world")
    assert detok._decode(ids) == "<hello world>"


def _texts(tokenizer, context, ids, skip, stream: bool, monkeypatch) -> list[str]:
    """The output text after each token, through the Rust stream or (``stream=False``) the
    Python offsets."""
    import vgraph.engine.detokenizer as module
    with monkeypatch.context() as patch:
        if not stream:
            patch.setattr(module, "_decode_stream", lambda *args: None)
        detok = IncrementalDetokenizer(tokenizer, context, skip_special_tokens=skip)
    assert (detok._stream is not None) == stream
    texts = []
    for token_id in ids:
        detok.update([token_id])
        texts.append(detok.output_text)
    return texts


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_the_rust_stream_equals_the_python_offsets(tokenizer, skip, seed, monkeypatch):
    """Random ids (byte tokens that split characters, special tokens) after a prompt context
    that holds a special token too: the same text after every token either way."""
    import random
    rng = random.Random(seed)
    context = [tokenizer.bos_token_id] + tokenizer.encode("hé")  # a short prompt: its BOS is context
    ids = [rng.randrange(len(tokenizer)) for _ in range(60)]
    assert (_texts(tokenizer, context, ids, skip, True, monkeypatch)
            == _texts(tokenizer, context, ids, skip, False, monkeypatch))


def test_a_metaspace_tokenizer_keeps_the_first_tokens_space(monkeypatch):
    """SentencePiece-style decoding strips a sequence's leading space: the prompt's context
    keeps the first output token's, in the stream as in Python."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS * 3, trainer=trainers.BpeTrainer(vocab_size=200, special_tokens=["<s>", "</s>"]))
    sp = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    context, ids = sp.encode("hello"), sp.encode(" world, hello there")
    texts = _texts(sp, context, ids, True, True, monkeypatch)
    assert texts == _texts(sp, context, ids, True, False, monkeypatch)
    assert texts[-1] == " world, hello there"


def test_a_failing_stream_hands_over_to_python(tokenizer, monkeypatch):
    """Should the Rust stream refuse a step, the sequence goes on in Python from the last
    emitted token: nothing lost, nothing repeated."""
    text = "héllo wörld 日本語 the café"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hello"), skip_special_tokens=True)
    stream, backend = detok._stream

    class Failing:
        calls = 0

        def step(self, backend, token_id):
            Failing.calls += 1
            if Failing.calls == 7:
                raise Exception("DecodeStreamError: invalid prefix")
            return stream.step(backend, token_id)
    detok._stream = (Failing(), backend)
    for token_id in ids:
        detok.update([token_id])
    assert detok._stream is None and detok.output_text == text
