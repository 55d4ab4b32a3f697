"""`LLM`: the vLLM-shaped facade. `generate` returns finished outputs; `stream` yields deltas.

    llm = LLM(model="path/to/checkpoint", max_num_seqs=16, max_model_len=4096)
    outputs = llm.generate(["def fib(n):", [0, 17, 42]], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from deepinfer_jax.api.model import Model, load
from deepinfer_jax.config.engine import QUICKSTART_SHAPES, EngineConfig
from deepinfer_jax.engine.core import EngineCore, failed_output
from deepinfer_jax.engine.devices import local_device_facts
from deepinfer_jax.host.detokenizer import IncrementalDetokenizer
from deepinfer_jax.host.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    SpecMetrics,
)
from deepinfer_jax.host.tokenizer import TextTokenizer


@dataclasses.dataclass(frozen=True)
class CompletionDelta:
    """One increment of a streamed request."""

    index: int                      # position of the prompt in the call
    request_id: str
    token_ids: list[int]            # new tokens since the previous delta
    text: str | None                # new text since the previous delta (with a tokenizer)
    finished: bool
    finish_reason: FinishReason | None = None
    error: RequestError | None = None


_ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)}
# The project's own trained checkpoint: the default model.
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "deepinfer-tiny-v4"


class LLM:
    def __init__(self, model: str | Path | Model | None = None, *, dtype=None,
                 tokenizer: str | Path | None = None, **engine_options):
        """model: a checkpoint directory, a loaded `Model`, or None for the shipped tiny model
        (with QUICKSTART_SHAPES where no shape is given).
        engine_options: the fields of `EngineConfig` (max_num_seqs, max_model_len,
        max_num_batched_tokens, num_pages, async_scheduling, batch_invariant, seed, ...)."""
        unknown = set(engine_options) - _ENGINE_OPTIONS
        if unknown:
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; "
                            f"known: {sorted(_ENGINE_OPTIONS)}")
        if model is None:
            if not (DEFAULT_MODEL / "config.json").exists():
                raise FileNotFoundError(f"no model given and the default {DEFAULT_MODEL} is missing")
            model = DEFAULT_MODEL
            engine_options = {**QUICKSTART_SHAPES, **engine_options}
        if isinstance(model, Model):
            self.model, self.tokenizer = model, None
        elif isinstance(model, (str, Path)):
            self.model = load(model, dtype=dtype)
            self.tokenizer = TextTokenizer.from_model_dir(model)
        else:
            raise TypeError(f"model must be a path or a deepinfer_jax.Model, got {type(model)}")
        if tokenizer is not None:     # a tokenizer.json, or a directory holding one
            path = Path(tokenizer)
            self.tokenizer = TextTokenizer.from_model_dir(path.parent if path.is_file() else path)
        options = EngineConfig(**engine_options)
        self.step_config = options.resolve(self.model.config, local_device_facts())
        self.host_options = options.host_options(self.step_config)
        self.engine = EngineCore(self.model.config, self.model.params, self.step_config,
                                 self.host_options, self.tokenizer)
        self._ids = itertools.count()
        self._spec_totals = SpecMetrics()

    # ---- public API -----------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        outputs: dict[str, RequestOutput] = {}
        pending = self._submit(prompts, sampling_params, outputs)
        bar = tqdm(total=len(outputs) + len(pending), desc="generating", unit="req",
                   disable=not use_tqdm)
        bar.update(len(outputs))
        while self.engine.has_unfinished():
            for req in self.engine.step():
                if req.is_complete and req.request_id in pending:
                    outputs[req.request_id] = self._output(pending.pop(req.request_id))
                    self._count_spec(req)
                    bar.update(1)
        bar.close()
        for rid, req in pending.items():       # aborted from elsewhere
            outputs[rid] = self._output(req)
        return [outputs[rid] for rid in self._order]

    def stream(self, prompts, sampling_params=None) -> Iterator[CompletionDelta]:
        """Yield each request's new tokens (and text) as soon as a step produces them."""
        outputs: dict[str, RequestOutput] = {}
        pending = self._submit(prompts, sampling_params, outputs)
        index = {rid: i for i, rid in enumerate(self._order)}
        for rid, out in outputs.items():
            yield CompletionDelta(index[rid], rid, [], None, True, out.finish_reason, out.error)
        sent_tokens = {rid: 0 for rid in pending}
        sent_text = {rid: "" for rid in pending}
        # a request's resolved tokens only grow, so its text is decoded a piece at a time:
        # final_text + pending text == decode(resolved tokens)
        detokenizers = {rid: IncrementalDetokenizer(self.tokenizer) for rid in pending
                        } if self.tokenizer is not None else {}
        final_text = {rid: "" for rid in pending}
        while pending and self.engine.has_unfinished():
            for req in self.engine.step():
                rid = req.request_id
                if rid not in pending:
                    continue
                known = req.resolved_tokens
                new = known[sent_tokens[rid]:]
                sent_tokens[rid] = len(known)
                done = req.is_complete
                text = None
                if self.tokenizer is not None:
                    final_text[rid] += detokenizers[rid].add(new)
                    decoded = final_text[rid] + detokenizers[rid].pending
                    full = _streamable_text(decoded, req, done)
                    text, sent_text[rid] = full[len(sent_text[rid]):], full
                if done:
                    pending.pop(rid)
                yield CompletionDelta(index[rid], rid, new, text, done, req.finish_reason)
        for rid, req in pending.items():       # aborted while streaming
            yield CompletionDelta(index[rid], rid, [], None, True, req.finish_reason)

    def _count_spec(self, req: Request) -> None:
        for field in ("steps", "drafted", "accepted"):
            setattr(self._spec_totals, field,
                    getattr(self._spec_totals, field) + getattr(req.spec, field))

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id) is not None

    # ---- internals ------------------------------------------------------------------------
    def _submit(self, prompts, sampling_params, outputs: dict) -> dict[str, Request]:
        prompts = _normalize_prompts(prompts)
        params = _normalize_params(sampling_params, len(prompts))
        self._order = []
        pending: dict[str, Request] = {}
        for prompt, p in zip(prompts, params, strict=True):
            rid = str(next(self._ids))
            self._order.append(rid)
            try:
                p = SamplingParams.from_dict(p) if isinstance(p, dict) else p
                pending[rid] = self.engine.add_request(rid, self._tokens(prompt), p)
            except (RequestError, TypeError) as e:
                err = e if isinstance(e, RequestError) else InvalidRequestError(str(e))
                outputs[rid] = failed_output(rid, prompt, err)
        return pending

    def _tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer.json in the model "
                                          "directory; pass token ids instead")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _output(self, req: Request) -> RequestOutput:
        text = None if self.tokenizer is None else self.tokenizer.decode(req.generated)
        out = req.output(text)
        out.batch_invariant = self.step_config.batch_invariant
        out.spec = req.spec if self.step_config.spec_tokens else None
        return out

    @property
    def prefix_cache_stats(self):
        """Prefix-cache counters (hits, reused and replayed tokens, cached blocks), or None
        when prefix caching is off."""
        return self.engine.scheduler.kv_cache.prefix_stats()

    @property
    def spec_metrics(self):
        """Speculative decoding counters summed over the requests this LLM finished."""
        return self._spec_totals


def _streamable_text(text: str, req: Request, done: bool) -> str:
    """The part of the text that may be shown: cut at a stop string, and while running, hold
    back a tail that could still grow into one."""
    if req.stop_text_at is not None:
        return text[: req.stop_text_at]
    if done or not req.params.stop:
        return text
    for keep in range(len(text) - max(len(s) for s in req.params.stop) + 1, len(text) + 1):
        tail = text[max(keep, 0):]
        if not any(s.startswith(tail) for s in req.params.stop if tail):
            continue
        return text[: max(keep, 0)]
    return text


def _is_tokens(x) -> bool:
    return isinstance(x, (list, tuple, np.ndarray)) and all(
        isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x)


def _normalize_prompts(prompts) -> list:
    """One prompt (a string or a token list) or a sequence of them -> a list of prompts."""
    if isinstance(prompts, str) or (_is_tokens(prompts) and len(prompts) > 0):
        return [prompts]
    if isinstance(prompts, dict) and "prompt_token_ids" in prompts:
        return [list(prompts["prompt_token_ids"])]
    if not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a string, a token-id list, or a list of those; "
                        f"got {type(prompts).__name__}")
    out = []
    for p in prompts:
        if isinstance(p, dict) and "prompt_token_ids" in p:
            p = list(p["prompt_token_ids"])
        if not (isinstance(p, str) or _is_tokens(p)):
            raise TypeError(f"each prompt must be a string or a list of token ids, got {p!r:.80}")
        out.append(p)
    return out


def _normalize_params(sampling_params, n: int) -> list:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, (SamplingParams, dict)):
        return [sampling_params] * n
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling params for {n} prompts")
        for p in sampling_params:
            if not isinstance(p, (SamplingParams, dict)):
                raise TypeError(f"sampling params must be SamplingParams or dict, got {type(p)}")
        return list(sampling_params)
    raise TypeError(f"sampling_params must be SamplingParams, a dict or a list of them, "
                    f"got {type(sampling_params).__name__}")
