"""The request bodies of the OpenAI API (pydantic), with vLLM's extensions for the engine's
other sampling controls and structured output (guided_json / guided_regex / guided_grammar).
Fields are typed strictly enough that a wrong type is a 400 naming the field; values are
checked by the engine (SamplingParams.problems), which names the parameter too."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str | None = None
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """The fields both endpoints share. None: the model's generation_config.json default,
    else OpenAI's."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    model: str
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    # a string, or OpenAI's list of parts ({"type": "text", "text": ...})
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # options of the model's chat format, e.g. {"thinking": true} for DeepSeek-V4's
    chat_template_kwargs: dict[str, Any] | None = None
