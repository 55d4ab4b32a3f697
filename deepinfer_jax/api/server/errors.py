"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, and which request
parameter an engine error is about.

The engine's messages name the parameter they are about first ("temperature must be ...",
"json_schema is not JSON: ..."); `param_of` reads that name and gives it as the API calls it
(json_schema is the request's response_format or guided_json, ...)."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from deepinfer_jax.host.grammar import GrammarError


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 kind: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.type, self.code = type, code
        self.kind = kind            # the errors-by-kind metric's label

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# The engine's parameter names that the API spells otherwise, by endpoint kind.
_API_NAMES = {
    "completion": {"json_schema": "response_format", "regex": "guided_regex",
                   "grammar": "guided_grammar", "stop strings": "stop", "stop string": "stop"},
    "chat": {"json_schema": "response_format", "regex": "guided_regex",
             "grammar": "guided_grammar", "stop strings": "stop", "stop string": "stop",
             "logprobs": "top_logprobs"},
}
_LEADING_NAME = re.compile(r"(stop strings?|[a-z_]+)\b")
_CONTEXT = re.compile(r"^prompt of \d+ tokens")


def engine_error(error: Exception, endpoint: str, names: dict[str, str] | None = None
                 ) -> APIError:
    """The APIError of a request the engine refused (an InvalidRequestError, a GrammarError,
    or the TypeError of a wrong-typed option). names: this request's own spellings (e.g.
    max_tokens given as max_completion_tokens)."""
    message = str(error)
    first = message.split("; ")[0]
    prompt_param = "messages" if endpoint == "chat" else "prompt"
    if _CONTEXT.match(first):
        return APIError(message, prompt_param, code="context_length_exceeded",
                        kind="context_length")
    if first.startswith(("empty prompt", "token ids outside", "a sequence of")):
        return APIError(message, prompt_param)
    if isinstance(error, GrammarError) or "grammar allows no token" in first:
        param = _grammar_param(first, endpoint, names)
        return APIError(message, param, code="invalid_grammar", kind="grammar")
    match = _LEADING_NAME.match(first)
    param = match.group(1) if match else None
    if param is not None:
        param = (names or {}).get(param) or _API_NAMES[endpoint].get(param, param)
    return APIError(message, param)


def _grammar_param(message: str, endpoint: str, names: dict[str, str] | None) -> str | None:
    for engine_name in ("json_schema", "regex", "grammar"):
        if engine_name in (names or {}):
            return names[engine_name]
    match = _LEADING_NAME.match(message)
    if match and match.group(1) in ("json_schema", "regex", "grammar"):
        return _API_NAMES[endpoint][match.group(1)]
    return None
