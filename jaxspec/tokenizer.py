"""Text <-> token ids for the example and benchmark scripts.

The decoding engine works on ids only; scripts talk to a tokenizer through the small `Tokenizer`
protocol (`encode`, `decode`, `eos_token_id`), so a checkpoint's own tokenizer can be added to
`load_tokenizer` without touching its callers. `load_tokenizer` knows two: `ByteTokenizer`, UTF-8
bytes, the vocabulary of the `tiny` presets; and `HFTokenizer`, a checkpoint's Hugging Face
`tokenizer.json` read with the `tokenizers` library (installed with the `hf` extra).
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol, Sequence


class Tokenizer(Protocol):
    """What a decoding script needs from a tokenizer."""

    @property
    def eos_token_id(self) -> int | None:
        """The id that ends a sequence (decoding stops a row after emitting it), or None."""

    def encode(self, text: str) -> list[int]:
        """`text` as token ids, without special tokens."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens left out."""


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text, 256 is BOS and 257 EOS: a vocabulary of 258.

    `encode` adds no BOS: the tiny models are trained on raw byte windows, which start anywhere
    in a text. `decode` replaces byte sequences that are not valid UTF-8 (a model's output can
    stop inside a character) with U+FFFD rather than failing.
    """

    vocab_size = 258
    bos_token_id = 256
    eos_token_id = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"ids {bad[:5]} are outside the byte vocabulary [0, {self.vocab_size})")
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


HF_TOKENIZER_FILE = "tokenizer.json"


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (DeepSeek's, or any other) through the `tokenizers` library.

    `encode` adds no special tokens (the protocol's contract); a chat or BOS prefix is the caller's
    choice, with `bos_token_id` at hand. The BOS and EOS ids come from `tokenizer_config.json`
    (`bos_token` / `eos_token`, a string or `{"content": ...}`), else from `config.json`.
    """

    def __init__(self, directory: str | os.PathLike):
        from tokenizers import Tokenizer as _Tokenizer  # optional dependency (the hf extra)

        directory = os.fspath(directory)
        self._tokenizer = _Tokenizer.from_file(os.path.join(directory, HF_TOKENIZER_FILE))
        settings = {**_read_json(os.path.join(directory, "config.json")),
                    **_read_json(os.path.join(directory, "tokenizer_config.json"))}
        self.bos_token_id = self._special_id(settings, "bos")
        self._eos_token_id = self._special_id(settings, "eos")

    def _special_id(self, settings: dict[str, Any], kind: str) -> int | None:
        token = settings.get(f"{kind}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str) and (token_id := self._tokenizer.token_to_id(token)) is not None:
            return token_id
        token_id = settings.get(f"{kind}_token_id")
        return token_id[0] if isinstance(token_id, list) else token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)


def has_hf_tokenizer(directory: str | os.PathLike) -> bool:
    """True when `directory` holds a Hugging Face `tokenizer.json`."""
    return os.path.isfile(os.path.join(os.fspath(directory), HF_TOKENIZER_FILE))


def load_tokenizer(directory: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer for a checkpoint directory: its `tokenizer.json` (an `HFTokenizer`) if it has
    one, else the byte tokenizer; the byte tokenizer for None.

    Callers running a real checkpoint without a `tokenizer.json` should check `has_hf_tokenizer`
    and work in token ids: bytes would silently decode that model's ids as garbage.
    """
    if directory is None:
        return ByteTokenizer()
    if not os.path.isdir(directory):
        raise ValueError(f"tokenizer directory {os.fspath(directory)!r} does not exist")
    if has_hf_tokenizer(directory):
        return HFTokenizer(directory)
    return ByteTokenizer()
