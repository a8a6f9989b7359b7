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
