"""An OpenAI request as the engine's input: its prompts as token ids and its SamplingParams,
and the API's names of the parameters the engine knows by other names (errors.py names the
one a refusal is about).

Where the request leaves a value out: temperature and top_p take the model's
generation_config.json (do_sample false: greedy), else OpenAI's defaults (1.0); a chat
request without max_tokens / max_completion_tokens may run to the end of the context."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer_jax.api.server.errors import APIError
from deepinfer_jax.api.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from deepinfer_jax.host.chat import ChatTemplate
from deepinfer_jax.host.request import SamplingParams
from deepinfer_jax.host.tokenizer import TextTokenizer


def generation_defaults(model_dir: str | Path | None) -> dict:
    """temperature / top_p / top_k from the model's generation_config.json."""
    path = Path(model_dir) / "generation_config.json" if model_dir is not None else None
    if path is None or not path.exists():
        return {}
    config = json.loads(path.read_text())
    out = {k: config[k] for k in ("temperature", "top_p", "top_k") if k in config}
    if config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


class RequestBuilder:
    def __init__(self, tokenizer: TextTokenizer | None, chat_template: ChatTemplate | None,
                 max_model_len: int, defaults: dict):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self.max_model_len, self.defaults = max_model_len, defaults

    # ---- prompts --------------------------------------------------------------------------
    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        prompt = req.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", "prompt")
        out = []
        for p in prompt:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise APIError("a text prompt needs the model's tokenizer.json; send token "
                                   "ids", "prompt")
                out.append(self.tokenizer.encode(p))
            else:
                out.append(list(p))
        return out

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or self.chat_template is None:
            raise APIError("this model has no chat template (chat_template.jinja or "
                           "tokenizer_config.json's chat_template)", "messages")
        messages = [{"role": m.role, "content": _content_text(m.content, i)}
                    for i, m in enumerate(req.messages)]
        try:
            text = self.chat_template.render(messages, req.add_generation_prompt,
                                             **(req.chat_template_kwargs or {}))
        except TypeError as e:        # an option the chat format does not take, or its type
            raise APIError(f"chat_template_kwargs: {e}", "chat_template_kwargs") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- sampling -------------------------------------------------------------------------
    def params(self, req: SamplingFields, max_tokens: int, logprobs: int | None,
               names: dict[str, str]) -> SamplingParams:
        """The request's SamplingParams; names gets the API names of the engine's options
        that the request spells otherwise."""
        if req.logit_bias:
            raise APIError("logit_bias is not supported", "logit_bias")
        constraint = _constraint(req, names)
        top_k = req.top_k if req.top_k is not None else self.defaults.get("top_k", 0)
        options = dict(
            max_tokens=max_tokens, n=req.n, seed=req.seed, stop=_stops(req.stop),
            temperature=_pick(req.temperature, self.defaults.get("temperature"), 1.0),
            top_p=_pick(req.top_p, self.defaults.get("top_p"), 1.0), top_k=top_k,
            min_p=req.min_p, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
            min_tokens=req.min_tokens, ignore_eos=req.ignore_eos,
            stop_token_ids=tuple(req.stop_token_ids or ()), logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, **constraint)
        if isinstance(req, CompletionRequest) and req.best_of is not None:
            options["best_of"] = req.best_of
        try:
            return SamplingParams(**options)
        except TypeError as e:       # a value of the wrong type that pydantic let through
            name = str(e).split(" ")[0]
            raise APIError(str(e), names.get(name, name)) from None

    def completion_params(self, req: CompletionRequest, names: dict[str, str]) -> SamplingParams:
        if req.echo:
            raise APIError("echo is not supported", "echo")
        if req.suffix:
            raise APIError("suffix is not supported", "suffix")
        return self.params(req, req.max_tokens if req.max_tokens is not None else 16,
                           req.logprobs, names)

    def chat_params(self, req: ChatCompletionRequest, prompt_len: int,
                    names: dict[str, str]) -> SamplingParams:
        max_tokens = req.max_completion_tokens
        if max_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        else:
            max_tokens = req.max_tokens
        if max_tokens is None:           # the rest of the context
            max_tokens = max(self.max_model_len - prompt_len, 1)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs needs logprobs=true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        return self.params(req, max_tokens, logprobs, names)


def _pick(value, default, fallback):
    return value if value is not None else default if default is not None else fallback


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _content_text(content, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(f"messages[{index}].content: only text parts are supported",
                           f"messages[{index}].content")
        parts.append(part["text"])
    return "".join(parts)


# json_object: any JSON object (llguidance's JSON schema compiler takes this schema)
_ANY_OBJECT = {"type": "object"}


def _constraint(req: SamplingFields, names: dict[str, str]) -> dict:
    given = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("json_schema", _ANY_OBJECT, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError("response_format json_schema needs json_schema.schema",
                           "response_format")
        given.append(("json_schema", fmt.json_schema.json_schema, "response_format"))
    if req.guided_json is not None:
        given.append(("json_schema", req.guided_json, "guided_json"))
    if req.guided_regex is not None:
        given.append(("regex", req.guided_regex, "guided_regex"))
    if req.guided_grammar is not None:
        given.append(("grammar", req.guided_grammar, "guided_grammar"))
    if len(given) > 1:
        raise APIError("give at most one of response_format (json), guided_json, guided_regex, "
                       "guided_grammar", given[1][2])
    if not given:
        return {}
    engine_name, value, api_name = given[0]
    names[engine_name] = api_name
    return {engine_name: value}
