"""Tokenizers: a dependency-free byte-level one and a Hugging Face ``tokenizer.json`` wrapper.

Both expose the same small surface the rest of meshtrain relies on: ``encode(text) -> list[int]``
(no end-of-sequence id added), ``decode(ids) -> str``, and the attributes ``vocab_size``,
``eos_id`` (``None`` when the tokenizer has none) and ``name`` (a short human-readable label).
:func:`load_tokenizer` turns the ``data.tokenizer`` config string into one of them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from meshtrain.config import ConfigError

BYTES_SPEC = "bytes"
"""The ``data.tokenizer`` value that selects :class:`ByteTokenizer`."""

EOS_TOKEN_NAMES = ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>")
"""Token strings recognised as end-of-sequence in a Hugging Face tokenizer, in preference order."""


class ByteTokenizer:
    """Byte-level tokenizer: the UTF-8 bytes of the text are the ids.

    Ids 0..255 are the byte values, 256 is end-of-sequence and 257..263 are reserved (unused), so
    ``vocab_size`` is 264. The padding to 264 is deliberate: 264 = 8 × 33, so the embedding and the
    output projection split evenly over tensor-parallel degrees 2, 4 and 8 without the model having
    to pad the vocabulary itself. Every string round-trips exactly; no file is needed.
    """

    vocab_size: int = 264
    eos_id: int = 256
    name: str = BYTES_SPEC

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids (no end-of-sequence id appended)."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode` but as a ``uint8`` numpy array, without a Python list (fast path)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids) -> str:
        """Text of the byte ids in ``ids``; ids >= 256 (eos, reserved) are skipped.

        Byte sequences that are not valid UTF-8 (e.g. a character cut in half) decode to U+FFFD
        instead of raising, since a model's samples can be any byte sequence.
        """
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a ``tokenizer.json`` file.

    ``vocab_size`` counts added tokens too (it is the number of embedding rows the model needs).
    ``eos_id`` is the id of the first of :data:`EOS_TOKEN_NAMES` the vocabulary contains, or
    ``None``. ``encode`` adds no special tokens (no BOS/EOS from the post-processor), so documents
    are delimited only by the eos id the data loader appends; ``decode`` skips special tokens.
    """

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f'data.tokenizer: "{path}" does not exist (or is not a file). Use "{BYTES_SPEC}" '
                "for the built-in byte-level tokenizer, or the path of a Hugging Face "
                "tokenizer.json file."
            )
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError(
                f'data.tokenizer: loading "{path}" needs the "tokenizers" package '
                '(pip install "meshtrain[data]"), or use "bytes".'
            ) from None
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises a bare Exception on parse errors
            raise ConfigError(
                f'data.tokenizer: "{path}" is not a valid Hugging Face tokenizer.json file '
                f"({error}). Use \"{BYTES_SPEC}\" for the built-in byte-level tokenizer."
            ) from None
        self.path = path
        self.name = str(path)
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = None
        for token in EOS_TOKEN_NAMES:
            token_id = self._tokenizer.token_to_id(token)
            if token_id is not None:
                self.eos_id = int(token_id)
                break

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, encoded in parallel by the Rust library (no special tokens)."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encodings]

    def encode_batch_offsets(self, texts: list[str]) -> list[tuple[list[int], list]]:
        """``(ids, offsets)`` of each text (no special tokens added): ``offsets[i]`` is the
        ``(start, end)`` character range of ``text`` that token ``i`` came from."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [(list(e.ids), list(e.offsets)) for e in encodings]

    def decode(self, ids) -> str:
        """Text of ``ids``, skipping special tokens (eos included)."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """The tokenizer named by ``data.tokenizer``: ``"bytes"`` or a ``tokenizer.json`` path."""
    if spec == BYTES_SPEC:
        return ByteTokenizer()
    return HFTokenizer(spec)


def tokenizer_vocab_size(spec: str) -> int:
    """Vocabulary size of the tokenizer ``spec`` names; no file I/O for ``"bytes"``.

    Used by config validation and the planner, which need the embedding size before any data is
    loaded.
    """
    if spec == BYTES_SPEC:
        return ByteTokenizer.vocab_size
    return load_tokenizer(spec).vocab_size
