"""Stop strings found as tokens arrive (no jax), searching only where a new match can be.

The answer is the one a search of the whole output text after every token would give: the
first token after which some stop string occurs in `decode(tokens so far)`, and the first
position of any stop string in that text. Incrementally: the text is the detokenizer's final
text plus its pending tail (detokenizer.py), and the final text only grows, so a match not
there at the previous search must end in what came after it; it starts at most
len(longest stop) - 1 characters before. Searches skipped (before min_tokens) leave the text
since the last search unsearched, so the first search covers the whole text.
"""

from __future__ import annotations

from deepinfer_jax.host.detokenizer import Decoder, IncrementalDetokenizer


class StopStrings:
    def __init__(self, tokenizer: Decoder, stops: tuple[str, ...]):
        if not stops or not all(stops):
            raise ValueError("stop strings must be non-empty")
        self.stops = stops
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._overlap = max(len(s) for s in stops) - 1
        self._unsearched_from = 0     # final-text position where the unsearched part starts
        self._unsearched = ""         # the final text from there on
        self.matched: str | None = None   # the stop string found (the first in the text)

    def add(self, token: int, search: bool = True) -> int | None:
        """Append a generated token; with `search`, return the position in the output text of
        the first stop string in it, or None."""
        self._unsearched += self._detokenizer.add([token])
        if not search:
            return None
        window = self._unsearched + self._detokenizer.pending
        hits = [(i, s) for i, s in ((window.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return self._unsearched_from + at
        keep = min(self._overlap, len(self._unsearched))   # a match may start in these
        self._unsearched_from += len(self._unsearched) - keep
        self._unsearched = self._unsearched[len(self._unsearched) - keep:]
        return None
