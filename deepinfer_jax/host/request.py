"""Requests as the host sees them: sampling parameters, lifecycle state, outputs, errors.

Value problems of one request (an empty prompt, a token outside the vocabulary, max_tokens
<= 0, an unknown option in a per-request dict) never raise: they come back as that request's
`RequestOutput` with `finish_reason == "error"` and `error` set. Misusing the API itself
(a wrong type) raises at once.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from deepinfer_jax.host.stop_strings import StopStrings


class RequestError(ValueError):
    """Base class of errors reported on one request's output."""


class InvalidRequestError(RequestError):
    """The request cannot be served as given (bad prompt or sampling parameters)."""


class FinishReason(str, enum.Enum):     # compares equal to vLLM's strings ("stop", ...)
    STOP = "stop"        # EOS or a stop token
    LENGTH = "length"    # max_tokens or max_model_len reached
    ABORT = "abort"      # aborted by the caller
    ERROR = "error"      # invalid request; see RequestOutput.error


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation controls (vLLM's names). Types are checked at construction;
    values when the request is submitted (a bad value fails that request only).

    temperature 0 is greedy (the default here, as the shipped model's generation config asks);
    top_k <= 0, top_p = 1 and min_p = 0 are off. `seed` fixes the request's random stream
    (derived from the seed and each token's position, so independent of batching); without
    one the engine draws a seed. `logprobs=n` returns the chosen token's logprob and the top n.
    At most one of json_schema / regex / grammar constrains the output.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    # vLLM's surface (api/llm.py and api/outputs.py); see outputs_problems for their values
    n: int = 1                            # completions returned per prompt
    best_of: int | None = None            # completions run (>= n); the n most likely returned
    prompt_logprobs: int | None = None    # each prompt token's logprob and the top k
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self):
        _check_surface_types(self)
        for name in ("max_tokens", "top_k", "min_tokens"):
            _check_type(name, getattr(self, name), int)
        for name in _FLOATS:
            _check_type(name, getattr(self, name), (int, float))
        _check_type("ignore_eos", self.ignore_eos, bool)
        for name in ("seed", "logprobs"):
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), int)
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                _check_type(name, getattr(self, name), str)
        if self.json_schema is not None:
            _check_type("json_schema", self.json_schema, (dict, str))
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise TypeError("stop must be a string or a sequence of strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) for t in self.stop_token_ids):
            raise TypeError("stop_token_ids must be a sequence of ints")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> "SamplingParams":
        unknown = set(options) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise InvalidRequestError(f"unknown sampling option(s): {sorted(unknown)}")
        return cls(**options)

    @property
    def constrained(self) -> bool:
        return any(x is not None for x in (self.json_schema, self.regex, self.grammar))

    @property
    def truncates(self) -> bool:
        """Whether sampling keeps only part of the distribution (top-k, top-p or min-p at a
        positive temperature), which takes the sampler that sorts the vocabulary. Compared in
        float32, as the plan carries the values, so that the host's choice of compiled sampler
        agrees with what the step's rows ask for at the edges (a top_p of 1 - 1e-9 is 1).
        Not cached in the instance: its __dict__ stays the fields alone, as callers copy
        params with SamplingParams(**vars(params))."""
        f32 = np.float32
        return bool(f32(self.temperature) > 0 and (self.top_k > 0 or f32(self.top_p) < 1
                                                   or f32(self.min_p) > 0))

    def problems(self, vocab_size: int, max_logprobs: int, has_tokenizer: bool) -> list[str]:
        """What is wrong with these values (each message names the parameter and its range);
        NaN and infinities fail every range, as no comparison holds for NaN and each check
        asks for finite values where infinity would pass."""
        finite = {name: math.isfinite(getattr(self, name)) for name in _FLOATS}
        checks = [
            (self.max_tokens > 0, f"max_tokens must be > 0, got {self.max_tokens}"),
            (finite["temperature"] and self.temperature >= 0,
             f"temperature must be finite and >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.top_k >= -1, f"top_k must be >= -1 (0 or -1: off), got {self.top_k}"),
            (finite["repetition_penalty"] and self.repetition_penalty > 0,
             f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.seed is None or 0 <= self.seed < 2**32, f"seed must be in [0, 2**32), got {self.seed}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            (self.logprobs is None or 0 <= self.logprobs <= max_logprobs,
             f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}"),
            (sum(x is not None for x in (self.json_schema, self.regex, self.grammar)) <= 1,
             "give at most one of json_schema, regex, grammar"),
            (has_tokenizer or not (self.stop or self.constrained),
             "stop strings and structured output need the model's tokenizer.json"),
            (all(self.stop), "stop strings must not be empty"),
        ]
        out = [message for ok, message in checks if not ok]
        out += [f"stop string {s!r} is not valid Unicode text ({e.reason} at index {e.start})"
                for s, e in ((s, unicode_error(s)) for s in self.stop) if e is not None]
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            out.append(f"stop_token_ids outside the vocabulary: {bad}")
        return out


_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
           "frequency_penalty")


def unicode_error(text: str) -> UnicodeEncodeError | None:
    """Why `text` cannot be encoded as UTF-8 (a lone surrogate, e.g. from a bad decode with
    surrogateescape or a JSON "\\ud800" escape), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e
    return None


def _check_surface_types(p: SamplingParams) -> None:
    _check_type("n", p.n, int)
    for name in ("best_of", "prompt_logprobs"):
        if getattr(p, name) is not None:
            _check_type(name, getattr(p, name), int)
    for name in ("include_stop_str_in_output", "skip_special_tokens"):
        _check_type(name, getattr(p, name), bool)


def surface_problems(p: SamplingParams, max_logprobs: int) -> list[str]:
    """The values of the vLLM-surface options (n, best_of, prompt_logprobs)."""
    checks = [
        (p.n >= 1, f"n must be >= 1, got {p.n}"),
        (p.best_of is None or p.best_of >= p.n, f"best_of must be >= n ({p.n}), got {p.best_of}"),
        (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= max_logprobs,
         f"prompt_logprobs must be in [0, {max_logprobs}], got {p.prompt_logprobs}"),
    ]
    return [message for ok, message in checks if not ok]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or (
        hasattr(x, "dtype") and getattr(x.dtype, "kind", "") in "iu")


def _check_type(name: str, value, types) -> None:
    if isinstance(value, bool) and types is not bool:
        raise TypeError(f"{name} must be {types}, got bool")
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {types}, got {type(value).__name__}")


@dataclasses.dataclass
class SpecMetrics:
    """Speculative decoding counters of one request (or, summed, of the engine)."""

    steps: int = 0              # verify steps
    drafted: int = 0            # draft tokens verified
    accepted: int = 0           # draft tokens accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens produced per verify step (accepted drafts + the target's own token)."""
        return (self.accepted + self.steps) / self.steps if self.steps else 0.0


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The raw model log-probability of a generated token, and the top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]     # (token id, logprob), best first


@dataclasses.dataclass(frozen=True)
class Logprob:
    """vLLM's per-token logprob entry (an element of `CompletionOutput.logprobs[i]`)."""

    logprob: float
    rank: int | None = None              # 1 = most likely; None where the step did not rank it
    decoded_token: str | None = None     # the token's text alone (with a tokenizer)


@dataclasses.dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM's: `RequestOutput.outputs[i]`."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None = None         # with logprobs (or best_of)
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the chosen one and the top k
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None   # the stop token id or stop string; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """A prompt's result. `outputs[i]` are its completions (vLLM's shape, the documented way);
    the top-level text, token_ids, finish_reason and logprobs repeat outputs[0]'s."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                  # generated so far (all of them, not a delta)
    text: str | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: RequestError | None = None
    metrics: RequestMetrics | None = None
    logprobs: list[TokenLogprobs] | None = None
    batch_invariant: bool = False         # computed in batch-invariant mode
    spec: SpecMetrics | None = None       # speculative decoding counters (when enabled)
    outputs: list[CompletionOutput] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # [None, {id: Logprob}, ...]

    def __post_init__(self):
        if not self.outputs:       # one completion, from the top-level fields
            self.outputs = [CompletionOutput(0, self.text, self.token_ids,
                                             finish_reason=self.finish_reason)]


# A generated token whose value is still on the device (asynchronous scheduling): the step
# that consumes it reads the slot's last sampled token instead.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """A request's host-side lifecycle. `tokens` is prompt + generated; `num_computed` counts
    the leading tokens whose state (window, compressed rows) the device holds."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival_index: int
    metrics: RequestMetrics = dataclasses.field(default_factory=lambda: RequestMetrics(time.time()))
    generated: list[int] = dataclasses.field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    slot: int | None = None
    pages: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: RequestError | None = None     # why it ended, with finish_reason ERROR
    num_preemptions: int = 0
    seed: int = 0                         # the request's random stream (params.seed or drawn)
    logprobs: list[TokenLogprobs | None] = dataclasses.field(default_factory=list)  # per token
    matcher: Any = None                   # llguidance matcher of a constrained request
    stop_strings: StopStrings | None = None   # the stop-string search (with params.stop)
    num_checked: int = 0                  # generated tokens seen by stop strings / grammar
    stop_text_at: int | None = None       # where a stop string starts in the output text
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    ended_on_stop_token: bool = False     # the last token is EOS or a stop token id
    drafts: list[int] = dataclasses.field(default_factory=list)   # MTP drafts to verify next
    spec: "SpecMetrics" = dataclasses.field(default_factory=lambda: SpecMetrics())
    block_keys: list[int] = dataclasses.field(default_factory=list)  # prefix-cache block hashes
    # positions below this were computed before (by this request before a preemption, or by
    # the request that cached their blocks): feeding them again is a replay
    replay_until: int = 0
    # a bounded prefix replay (BatchPlan.window_from / rows_from), set at admission
    window_from: int = 0
    rows_from: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

    def token_slice(self, start: int, stop: int, num_drafts: int = 0) -> list[int]:
        """(prompt + generated + the first `num_drafts` drafts)[start:stop], in O(stop - start):
        the plan builder's per-step read, which must not copy a long context every step."""
        p, g = len(self.prompt), len(self.generated)
        return (self.prompt[start:stop]
                + self.generated[max(start - p, 0): max(stop - p, 0)]
                + self.drafts[:num_drafts][max(start - p - g, 0): max(stop - p - g, 0)])

    @property
    def num_pending(self) -> int:
        """Tokens not yet run through the model (1 when decoding)."""
        return self.num_tokens - self.num_computed

    @property
    def resolved_tokens(self) -> list[int]:
        """Generated tokens whose values the host has (a prefix of `generated`)."""
        if PLACEHOLDER in self.generated:
            return self.generated[: self.generated.index(PLACEHOLDER)]
        return self.generated

    @property
    def known_tokens(self) -> list[int]:
        """The prompt and the generated tokens the host has."""
        return self.prompt + self.resolved_tokens

    @property
    def has_placeholders(self) -> bool:
        return PLACEHOLDER in self.generated

    @property
    def is_complete(self) -> bool:
        """Finished, and every generated token is known on the host."""
        return self.status is RequestStatus.FINISHED and not self.has_placeholders

    def truncate(self, length: int) -> None:
        """Drop generated tokens from index `length` on (tokens computed after a stop)."""
        del self.generated[length:]
        del self.logprobs[length:]

    def output(self, text: str | None = None) -> RequestOutput:
        if text is not None and self.stop_text_at is not None:
            text = text[: self.stop_text_at]
        logprobs = list(self.logprobs) if self.params.logprobs is not None else None
        return RequestOutput(self.request_id, list(self.prompt), list(self.generated), text,
                             self.status is RequestStatus.FINISHED, self.finish_reason,
                             self.error, self.metrics, logprobs)
