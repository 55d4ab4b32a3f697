"""The host's per-token checks of a request's output (no jax): each newly resolved token goes,
in order, to the request's grammar matcher (grammar.py) and its stop strings (stop_strings.py).
Every token is checked once (`Request.num_checked`), and the checks stop at the first token
after which the output ends."""

from __future__ import annotations

from deepinfer_jax.host.request import PLACEHOLDER, InvalidRequestError, Request


class GrammarDeadEnd(InvalidRequestError):
    """The grammar allowed no further token: the output ends, as an error, before the token
    that broke it (its text still a prefix the grammar accepts)."""


def end_of_output(req: Request) -> int | None:
    """Check the tokens resolved since the last call. Returns the index of the generated token
    after which the output ends (its grammar complete or failed, or a stop string found, whose
    text position goes to `req.stop_text_at`), or None. A grammar dead end sets `req.error`
    and returns the index before the offending token (-1: none kept)."""
    generated = req.generated
    while req.num_checked < len(generated) and generated[req.num_checked] != PLACEHOLDER:
        index = req.num_checked
        req.num_checked = index + 1
        if req.matcher is not None:
            req.matcher.consume_token(generated[index])
            if req.matcher.is_error():
                req.error = GrammarDeadEnd(f"the grammar allows no token here: "
                                           f"{req.matcher.get_error()}")
                return index - 1
            if req.matcher.is_stopped():
                return index
        if req.stop_strings is not None:
            at = req.stop_strings.add(generated[index], search=index + 1 >= req.params.min_tokens)
            if at is not None:
                req.stop_text_at = at
                req.stop_reason = req.stop_strings.matched
                return index
    return None
