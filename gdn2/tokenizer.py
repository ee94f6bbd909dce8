"""A thin wrapper around a SentencePiece model, with the project's conventions.

Documents are encoded without BOS and followed by EOS in the training shards, so ``encode`` adds
neither by default; evaluation and generation put EOS in front of a text when they want the model to
see a document start, exactly as it saw one in training.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Sequence, Union

TOKENIZER_FILE = "tokenizer.model"


class Tokenizer:
    """SentencePiece tokenizer: ``encode(text) -> list[int]``, ``decode(ids) -> str``."""

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        import sentencepiece as spm

        path = Path(path)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer: SentencePiece model {str(path)!r} does not exist")
        self.path = path
        self.processor = spm.SentencePieceProcessor()
        try:
            self.processor.Load(str(path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"tokenizer: {str(path)!r} is not a SentencePiece model ({e})") from e

    @property
    def vocab_size(self) -> int:
        return int(self.processor.GetPieceSize())

    @property
    def bos_id(self) -> int:
        """Id of ``<s>`` (-1 when the model has none)."""
        return int(self.processor.bos_id())

    @property
    def eos_id(self) -> int:
        """Id of ``</s>`` (-1 when the model has none)."""
        return int(self.processor.eos_id())

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """Token ids of ``text``; BOS / EOS added only when asked."""
        if not isinstance(text, str):
            raise ValueError(f"encode: text must be a str, got {type(text).__name__}")
        ids = list(self.processor.EncodeAsIds(text))
        if bos:
            ids.insert(0, self._special(self.bos_id, "bos"))
        if eos:
            ids.append(self._special(self.eos_id, "eos"))
        return ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(ids) for ids in self.processor.EncodeAsIds(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` (special tokens render as nothing). Ids outside the vocabulary are an error."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"decode: ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        return self.processor.DecodeIds(ids)

    def _special(self, token_id: int, name: str) -> int:
        if token_id < 0:
            raise ValueError(f"tokenizer {str(self.path)!r} defines no {name} token")
        return token_id

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"
