"""The byte-level tokenizer of the tiny presets, and `load_tokenizer`'s choice."""

from __future__ import annotations

import pytest

from jaxspec.presets import preset
from jaxspec.tokenizer import ByteTokenizer, load_tokenizer


def test_round_trip_is_utf8_bytes():
    tokenizer = ByteTokenizer()
    text = "Speculative décodage ✓ \n\t"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_vocabulary_matches_the_tiny_preset():
    tokenizer, config = ByteTokenizer(), preset("tiny")
    assert tokenizer.vocab_size == config.vocab_size == 258
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257) == (256, config.eos_token_id)


def test_specials_are_never_encoded_and_skipped_when_decoding():
    tokenizer = ByteTokenizer()
    assert all(i < 256 for i in tokenizer.encode("any text"))
    assert tokenizer.decode([256, *b"hi", 257]) == "hi"


def test_decode_replaces_invalid_utf8_and_rejects_foreign_ids():
    tokenizer = ByteTokenizer()
    cut_character = "é".encode("utf-8")[:1]  # generation can stop inside a multi-byte character
    assert tokenizer.decode([*b"caf", *cut_character]) == "caf\ufffd"
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tokenizer.decode([104, 258])
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        tokenizer.decode([-1])


def test_load_tokenizer_without_a_tokenizer_file_gives_bytes(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
