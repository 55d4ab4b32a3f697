"""Text in and out, through the model directory's `tokenizer.json` (the `tokenizers` library)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from deepinfer_jax.host.request import InvalidRequestError, unicode_error


class TokenizerError(ValueError):
    """A tokenizer.json that the `tokenizers` library cannot load; names the file."""


class TextTokenizer:
    def __init__(self, tokenizer: Tokenizer, path: Path):
        self._tok = tokenizer
        self.path = path            # tokenizer.json (the grammar engine reads it too)

    @classmethod
    def from_model_dir(cls, directory: str | Path) -> "TextTokenizer | None":
        path = Path(directory) / "tokenizer.json"
        if not path.exists():
            return None
        try:
            return cls(Tokenizer.from_file(str(path)), path)
        except Exception as e:      # the library raises bare Exceptions (serde's messages)
            raise TokenizerError(f"{path}: not a tokenizer.json the `tokenizers` library can "
                                 f"load ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids, by default with the tokenizer's own special tokens (e.g. BOS) added (a
        rendered chat template carries its own). Text that is not valid Unicode (a lone
        surrogate) fails this request, with where it is."""
        error = unicode_error(text)
        if error is not None:
            raise InvalidRequestError(
                f"prompt is not valid Unicode text: {error.reason} "
                f"({text[error.start:error.end]!r} at index {error.start})")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """The text of `ids`; special tokens (the added tokens marked special, e.g. BOS/EOS)
        left out unless `skip_special_tokens` is False."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = True) -> "TextTokenizer | _KeepSpecials":
        """A `Decoder` (detokenizer.py) decoding as `SamplingParams.skip_special_tokens` asks."""
        return self if skip_special_tokens else _KeepSpecials(self)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class _KeepSpecials:
    def __init__(self, tokenizer: TextTokenizer):
        self._tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)
