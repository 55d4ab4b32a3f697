"""Text in and out, through the model directory's `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, path: Path):
        self._tok = tokenizer
        self.path = path            # tokenizer.json (the grammar engine reads it too)

    @classmethod
    def from_model_dir(cls, directory: str | Path) -> "TextTokenizer | None":
        path = Path(directory) / "tokenizer.json"
        return cls(Tokenizer.from_file(str(path)), path) if path.exists() else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        """Token ids with the tokenizer's own special tokens (e.g. BOS) added."""
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)
