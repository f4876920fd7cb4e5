"""Incremental detokenization and stop-string hold-back (no model needed)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.tokenizer.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer, StopStringFilter

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "hello world, hello there, hello again",
]
# Characters of 2, 3 and 4 UTF-8 bytes, absent from the training text, so the tokenizer has to
# spell them with byte tokens and a character is split across several tokens.
MULTIBYTE_TEXT = "Café 北京 says 😀 and 🎉! naïve ø"


def _byte_level_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<eos>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _metaspace_tokenizer() -> Any:
    """SentencePiece-style: a word's leading space is part of its token and is dropped when the
    token is decoded first, which is what breaks naive token-by-token decoding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def byte_tok() -> Any:
    return _byte_level_tokenizer()


@pytest.fixture(scope="module")
def meta_tok() -> Any:
    return _metaspace_tokenizer()


def _stream(tok: Any, ids: list[int], chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


def test_multibyte_characters_are_held_back_until_complete(byte_tok: Any) -> None:
    ids = byte_tok.encode(MULTIBYTE_TEXT)
    # The test is only meaningful if some character really spans several tokens.
    assert any(REPLACEMENT_CHAR in byte_tok.decode([i]) for i in ids)
    deltas = _stream(byte_tok, ids)
    assert "".join(deltas) == MULTIBYTE_TEXT
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_deltas_concatenate_to_the_full_decode(byte_tok: Any, meta_tok: Any, chunk: int) -> None:
    for tok in (byte_tok, meta_tok):
        for text in [*CORPUS, "hello  brown   fox"]:
            ids = tok.encode(text)
            assert "".join(_stream(tok, ids, chunk)) == tok.decode(ids)


def test_sentencepiece_spaces_survive_token_by_token(meta_tok: Any) -> None:
    text = "hello world hello there"
    ids = meta_tok.encode(text)
    deltas = _stream(meta_tok, ids)
    assert "".join(deltas) == meta_tok.decode(ids)
    assert " " in "".join(deltas[1:])  # later words keep their leading space


def test_special_tokens_are_skipped(byte_tok: Any) -> None:
    eos = byte_tok.convert_tokens_to_ids("<eos>")
    ids = byte_tok.encode("hello world") + [eos]
    assert "".join(_stream(byte_tok, ids)) == "hello world"


def test_flush_releases_an_incomplete_character(byte_tok: Any) -> None:
    ids = byte_tok.encode("😀")
    detok = IncrementalDetokenizer(byte_tok)
    assert detok.add(ids[:-1]) == ""  # three of four bytes: nothing yet
    assert detok.flush() != ""  # the request ended: show what there is


# ---------------------------------------------------------------- stop strings
def test_partial_stop_is_held_back_then_cut() -> None:
    f = StopStringFilter(["world"])
    assert f.feed("Hello wo") == "Hello "
    assert f.feed("rld and more") == ""
    assert f.matched == "world"
    assert f.feed("ignored") == "" and f.flush() == ""


def test_held_back_text_is_released_when_it_stops_matching() -> None:
    f = StopStringFilter(["world"])
    assert f.feed("wor") == ""
    assert f.feed("k") == "work"
    assert f.feed("s wo") == "s "
    assert f.flush() == "wo"


def test_earliest_stop_wins() -> None:
    f = StopStringFilter(["c", "ab"])
    assert f.feed("xxabc") == "xx" and f.matched == "ab"


def test_unchecked_text_passes_through() -> None:
    f = StopStringFilter(["stop"])
    assert f.feed("a stop b", check=False) == "a stop b"
    assert f.matched is None


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abcx ", max_size=40),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_any_chunking_gives_the_text_before_the_first_stop(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    f = StopStringFilter(stops)
    out = ""
    for chunk in chunks:
        released = f.feed(chunk)
        out += released
        assert not any(s in out for s in stops)  # a stop string never leaks
    out += f.flush()
    # Streaming semantics: the stop string that is completed first cuts the text.
    hits = [(i + len(s), i) for s in stops if (i := text.find(s)) >= 0]
    assert out == (text[: min(hits)[1]] if hits else text)
