"""Requests as the host sees them: sampling parameters, lifecycle state, outputs, errors.

Value problems of one request (an empty prompt, a token outside the vocabulary, max_tokens
<= 0, an unknown option in a per-request dict) never raise: they come back as that request's
`RequestOutput` with `finish_reason == "error"` and `error` set. Misusing the API itself
(a wrong type) raises at once.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any


class RequestError(ValueError):
    """Base class of errors reported on one request's output."""


class InvalidRequestError(RequestError):
    """The request cannot be served as given (bad prompt or sampling parameters)."""


class FinishReason(enum.Enum):
    STOP = "stop"        # EOS or a stop token
    LENGTH = "length"    # max_tokens or max_model_len reached
    ABORT = "abort"      # aborted by the caller
    ERROR = "error"      # invalid request; see RequestOutput.error


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation controls (vLLM's names). Types are checked at construction;
    values are checked when the request is submitted (a bad value fails that request only)."""

    max_tokens: int = 16
    temperature: float = 0.0            # 0: greedy
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        _check_type("max_tokens", self.max_tokens, int)
        _check_type("temperature", self.temperature, (int, float))
        _check_type("ignore_eos", self.ignore_eos, bool)
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

    def problems(self, vocab_size: int) -> list[str]:
        out = []
        if self.max_tokens <= 0:
            out.append(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            out.append(f"temperature must be >= 0, got {self.temperature}")
        if self.temperature > 0:
            out.append("temperature > 0 is not supported yet: only greedy decoding")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            out.append(f"stop_token_ids outside the vocabulary: {bad}")
        return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) or (
        hasattr(x, "dtype") and getattr(x.dtype, "kind", "") in "iu")


def _check_type(name: str, value, types) -> None:
    if isinstance(value, bool) and types is not bool:
        raise TypeError(f"{name} must be {types}, got bool")
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {types}, got {type(value).__name__}")


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                  # generated so far (all of them, not a delta)
    text: str | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: RequestError | None = None
    metrics: RequestMetrics | None = None


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
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)

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
    def has_placeholders(self) -> bool:
        return PLACEHOLDER in self.generated

    @property
    def is_complete(self) -> bool:
        """Finished, and every generated token is known on the host."""
        return self.status is RequestStatus.FINISHED and not self.has_placeholders

    def output(self, text: str | None = None) -> RequestOutput:
        return RequestOutput(self.request_id, list(self.prompt), list(self.generated), text,
                             self.status is RequestStatus.FINISHED, self.finish_reason,
                             None, self.metrics)
