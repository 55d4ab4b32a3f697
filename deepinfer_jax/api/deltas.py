"""One request's output as increments (no jax): the new tokens, text and logprobs since the
last call. `LLM.stream` and the server's engine loop both read requests through it, so a
streamed text is the same wherever it is streamed, and adds up to the finished output's.

A request's resolved tokens only grow, so its text is decoded a piece at a time
(final text + the detokenizer's pending text == decode(text tokens fed so far)); while it
runs, a tail that could still grow into a stop string is held back.
"""

from __future__ import annotations

import dataclasses

from deepinfer_jax.host.detokenizer import IncrementalDetokenizer
from deepinfer_jax.host.outputs import cut_at_stop, text_tokens
from deepinfer_jax.host.request import Request, TokenLogprobs
from deepinfer_jax.host.tokenizer import TextTokenizer


@dataclasses.dataclass(frozen=True)
class Increment:
    token_ids: list[int]                    # new tokens since the previous increment
    text: str | None                        # new text (with a tokenizer)
    logprobs: list[TokenLogprobs | None]    # the new tokens' entries (with params.logprobs)
    done: bool                              # the request is complete


class RequestDeltas:
    def __init__(self, req: Request, tokenizer: TextTokenizer | None):
        self.req = req
        self._tokenizer = tokenizer
        self._sent_tokens = 0
        self._sent_text = ""
        self._fed = 0
        self._final_text = ""
        self._detokenizer = (None if tokenizer is None else IncrementalDetokenizer(
            tokenizer.decoder(req.params.skip_special_tokens)))

    def advance(self) -> Increment:
        """What the request gained since the last call (call it after each step that touched
        the request, and once it is complete)."""
        req = self.req
        known = req.resolved_tokens
        start, self._sent_tokens = self._sent_tokens, len(known)
        new = known[start:]
        logprobs = list(req.logprobs[start:len(known)]) if req.params.logprobs is not None else []
        done = req.is_complete
        text = None
        if self._detokenizer is not None:
            shown = text_tokens(req, known) if done else known
            self._final_text += self._detokenizer.add(shown[self._fed:])
            self._fed = max(self._fed, len(shown))
            # the held-back tail (an unfinished character) only once it is final
            decoded = self._final_text + (self._detokenizer.pending if done else "")
            full = streamable_text(decoded, req, done)
            text, self._sent_text = full[len(self._sent_text):], full
        return Increment(new, text, logprobs, done)


def streamable_text(text: str, req: Request, done: bool) -> str:
    """The part of the text that may be shown: cut at a stop string, and while running, hold
    back a tail that could still grow into one."""
    if req.stop_text_at is not None:
        return cut_at_stop(text, req)
    if done or not req.params.stop:
        return text
    for keep in range(len(text) - max(len(s) for s in req.params.stop) + 1, len(text) + 1):
        tail = text[max(keep, 0):]
        if not any(s.startswith(tail) for s in req.params.stop if tail):
            continue
        return text[: max(keep, 0)]
    return text
