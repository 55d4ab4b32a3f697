"""Incremental detokenization (no jax): the text of a growing token sequence, decoding only the
new tokens and a few before them, as vLLM does (prefix and read offsets).

Invariant: `text + pending` equals `decode(all tokens added)`, where `text` (handed out
piecewise by `add`) never changes once given and `pending` is the text of the tokens after the
read offset, held back while it ends in U+FFFD: with byte-level tokenizers a token may end
inside a multi-byte character, which decodes to U+FFFD until the token that completes it
arrives. Once the decoded window ends in a whole character it is a prefix of every later
decode, and the offsets move past it.

The window decoded each time starts at the prefix offset, one emitted piece back, so that a
tokenizer whose decoding of a token depends on its neighbour (a word-initial space, say)
decodes it in context; the previous piece's text is cut off the front.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder):
        self._tokenizer = tokenizer
        self._window: list[int] = []   # the tokens from the prefix offset on
        self._read = 0                 # the read offset, within the window
        self._prefix_text = ""         # decode(window[:read])
        self.pending = ""              # decode of the tokens after the read offset, held back

    def add(self, ids: list[int]) -> str:
        """Append tokens; returns the text that became final (possibly "")."""
        self._window += ids
        text = self._tokenizer.decode(self._window)
        new = text[len(self._prefix_text):]
        if not new or new.endswith(REPLACEMENT):
            self.pending = new
            return ""
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text, self.pending = self._tokenizer.decode(self._window), ""
        return new
