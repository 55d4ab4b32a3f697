"""`LLM`: the vLLM-shaped facade. `generate` returns finished outputs; `stream` yields deltas;
`chat` renders conversations with the model's chat template.

    llm = LLM(model="path/to/checkpoint", max_num_seqs=16, max_model_len=4096)
    outputs = llm.generate(["def fib(n):", [0, 17, 42]], SamplingParams(max_tokens=32))
    outputs[0].outputs[0].text

`LLM(..., backend="ascend")` runs the same loop over the Ascend backend's engine (torch /
torch_npu; api/backends.py): this module imports no jax, and jax loads only for the JAX one.

A prompt with `n` (or `best_of`) > 1 runs as that many requests, seeded `seed + i` when the
prompt has a seed (vLLM's rule: reproducible, and the completions differ), grouped back into
one `RequestOutput` (host/outputs.py). `prompt_logprobs` come from the cache-free reference
forward (`Model.logits`, the oracle the engine's step is tested against) run once over the
prompt when its output is assembled: the step computes logits only at sampled rows, and a
prompt's logprobs are needed once, so a separate forward costs no change to the step.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from deepinfer_jax.api.backends import start_engine
from deepinfer_jax.api.deltas import RequestDeltas
from deepinfer_jax.config.engine import QUICKSTART_SHAPES, EngineConfig
from deepinfer_jax.host.chat import ChatTemplate
from deepinfer_jax.host.deepseek_v4_chat import chat_format
from deepinfer_jax.host.outputs import failed_output, group_output, prompt_logprobs, token_text
from deepinfer_jax.host.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    RequestError,
    RequestOutput,
    SamplingParams,
    SpecMetrics,
    surface_problems,
)

__all__ = ["LLM", "CompletionDelta", "DEFAULT_MODEL", "chat_format"]


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
    output_index: int = 0           # which of the prompt's n completions


@dataclasses.dataclass
class _Group:
    """One prompt of a call: its requests (best_of or n of them), or its failure."""

    request_id: str
    params: SamplingParams | None
    requests: list[Request]
    failed: RequestOutput | None = None


_ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)}
# The project's own trained checkpoint: the default model.
DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "models" / "deepinfer-tiny-v4"


class LLM:
    # model: a path, a Model / V41Model (api/model.py, not imported here: it imports jax), None
    def __init__(self, model=None, *, dtype=None,
                 weights: str = "quantized", tokenizer: str | Path | None = None,
                 load_format: str = "auto", dummy_layers: int | None = None,
                 **engine_options):
        """model: a checkpoint directory (DeepSeek-V4 or V4.1), a loaded `Model` / `V41Model`,
        or None for the shipped tiny model (with QUICKSTART_SHAPES where no shape is given).
        weights: "quantized" keeps a checkpoint's FP8/FP4 weights as stored, "bf16"
        dequantizes them at load (api/model.py's load).
        load_format: "auto" reads the checkpoint; "dummy" builds random weights from the
        model's config alone (a directory or a config.json; api/dummy.py), cut to
        `dummy_layers` layers where given.
        engine_options: the fields of `EngineConfig` (max_num_seqs, max_model_len,
        max_num_batched_tokens, num_pages, gpu_memory_utilization, device_memory_gib,
        async_scheduling, batch_invariant, seed, ...). Where the device's memory is known
        (a GPU's, or stated), the page pool is planned from it (`memory_plan`) and a model
        that does not fit raises InsufficientMemoryError before anything compiles.
        backend (an engine option): "jax" (default; DEEPINFER_BACKEND where not given) or
        "ascend" (torch / torch_npu, ascend_backend/: a checkpoint directory only); both run
        under this class's host loop and the shared scheduler (api/backends.py)."""
        if dummy_layers is not None and load_format != "dummy":
            raise ValueError("dummy_layers cuts a load_format='dummy' model's config")
        unknown = set(engine_options) - _ENGINE_OPTIONS
        if unknown:
            raise TypeError(f"unknown engine option(s) {sorted(unknown)}; "
                            f"known: {sorted(_ENGINE_OPTIONS)}")
        if model is None:
            if not (DEFAULT_MODEL / "config.json").exists():
                raise FileNotFoundError(f"no model given and the default {DEFAULT_MODEL} is missing")
            model = DEFAULT_MODEL
            engine_options = {**QUICKSTART_SHAPES, **engine_options}
        options = EngineConfig(**engine_options)     # the backend resolved here, once
        # jax's modules load here, and only for the JAX backend (api/backends.py)
        self.engine, self.model, self.tokenizer, self.chat_template = start_engine(
            options, model, dtype=dtype, weights=weights, tokenizer=tokenizer,
            load_format=load_format, dummy_layers=dummy_layers)
        self.backend = options.backend
        self.host_options = self.engine.host
        self.step_config = self.engine.step_cfg          # with the planned page pool
        self._ids = itertools.count()
        self._spec_totals = SpecMetrics()

    # ---- public API -----------------------------------------------------------------------
    def generate(self, prompts, sampling_params=None, *, use_tqdm: bool = True
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order, each prompt's
        completions in `outputs[i]`."""
        groups = self._submit(prompts, sampling_params)
        pending = {r.request_id: r for g in groups for r in g.requests}
        bar = tqdm(total=sum(len(g.requests) or 1 for g in groups), desc="generating",
                   unit="req", disable=not use_tqdm)
        bar.update(sum(g.failed is not None for g in groups))
        while self.engine.has_unfinished():
            for req in self.engine.step():
                if req.is_complete and pending.pop(req.request_id, None) is not None:
                    self._count_spec(req)
                    bar.update(1)
        bar.close()
        return [self._group_output(g) for g in groups]   # aborted ones too, as they are

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, chat_template: str | None = None
             ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} dicts) or a list
        of them, rendered with the model's chat template (host/chat.py) or `chat_template`."""
        if self.tokenizer is None:
            raise ValueError("chat needs the model's tokenizer.json")
        template = self.chat_template
        if chat_template is not None:
            template = ChatTemplate(chat_template, getattr(template, "special_tokens", None))
        if template is None:
            raise ValueError("the model has no chat template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template); pass chat_template=")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(template.render(c, add_generation_prompt),
                                         add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(self, prompts, sampling_params=None) -> Iterator[CompletionDelta]:
        """Yield each request's new tokens (and text) as soon as a step produces them. A
        consumer that stops early (closes the generator, or breaks out of a for loop over it)
        aborts its unfinished requests, freeing their pages at once."""
        groups = self._submit(prompts, sampling_params, streaming=True)
        where = {r.request_id: (i, j) for i, g in enumerate(groups)
                 for j, r in enumerate(g.requests)}
        pending = {r.request_id: r for g in groups for r in g.requests}
        try:
            yield from self._stream(groups, where, pending)
        finally:
            for rid in list(pending):   # the consumer stopped: nothing will read these
                self.engine.abort(rid)

    def _stream(self, groups: list[_Group], where: dict, pending: dict[str, Request]
                ) -> Iterator[CompletionDelta]:
        for i, g in enumerate(groups):
            if g.failed is not None:
                yield CompletionDelta(i, g.request_id, [], None, True, g.failed.finish_reason,
                                      g.failed.error)
        deltas = {rid: RequestDeltas(req, self.tokenizer) for rid, req in pending.items()}
        while pending and self.engine.has_unfinished():
            for req in self.engine.step():
                rid = req.request_id
                if rid not in pending:
                    continue
                inc = deltas[rid].advance()
                if inc.done:
                    pending.pop(rid)
                i, j = where[rid]
                yield CompletionDelta(i, groups[i].request_id, inc.token_ids, inc.text, inc.done,
                                      req.finish_reason, output_index=j)
        for rid, req in list(pending.items()):       # aborted while streaming
            pending.pop(rid)
            i, j = where[rid]
            yield CompletionDelta(i, groups[i].request_id, [], None, True, req.finish_reason,
                                  output_index=j)

    def _count_spec(self, req: Request) -> None:
        for field in ("steps", "drafted", "accepted"):
            setattr(self._spec_totals, field,
                    getattr(self._spec_totals, field) + getattr(req.spec, field))

    def abort(self, request_id: str) -> bool:
        return self.engine.abort(request_id) is not None

    # ---- internals ------------------------------------------------------------------------
    def _submit(self, prompts, sampling_params, streaming: bool = False) -> list[_Group]:
        prompts = _normalize_prompts(prompts)
        params = _normalize_params(sampling_params, len(prompts))
        groups = []
        for prompt, p in zip(prompts, params, strict=True):
            group = _Group(str(next(self._ids)), None, [])
            groups.append(group)
            try:
                p = group.params = SamplingParams.from_dict(p) if isinstance(p, dict) else p
                problems = surface_problems(p, self.step_config.max_logprobs)
                if streaming and (p.best_of or p.n) > p.n:
                    problems.append("best_of > n chooses among finished completions; "
                                    "it cannot stream (use generate)")
                if problems:
                    raise InvalidRequestError("; ".join(problems))
                tokens = self._tokens(prompt)
                children = _children(p)
                for i, child in enumerate(children):
                    rid = group.request_id if len(children) == 1 else f"{group.request_id}-{i}"
                    group.requests.append(self.engine.add_request(rid, tokens, child))
            except (RequestError, TypeError) as e:
                for req in group.requests:
                    self.engine.abort(req.request_id)
                group.requests = []
                err = e if isinstance(e, RequestError) else InvalidRequestError(str(e))
                group.failed = failed_output(group.request_id, prompt, err)
        return groups

    def _tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer.json in the model "
                                          "directory; pass token ids instead")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _group_output(self, group: _Group) -> RequestOutput:
        if group.failed is not None:
            return group.failed
        p = group.params
        prompt_lps = None
        if p.prompt_logprobs is not None:
            prompt = group.requests[0].prompt
            prompt_lps = prompt_logprobs(prompt, self.model.logits(prompt)[0], p.prompt_logprobs,
                                         token_text(self.tokenizer))
        out = group_output(group.request_id, group.requests, p.n, self.tokenizer,
                           p.logprobs is not None, prompt_lps)
        out.batch_invariant = self.step_config.batch_invariant
        out.spec = group.requests[0].spec if self.step_config.spec_tokens else None
        return out

    @property
    def memory_plan(self):
        """The device memory plan (weights, measured activations, cache, pages), or None where
        the device's memory is not known (the CPU, unless device_memory_gib is given)."""
        return self.engine.memory_plan

    def rebalance_experts(self) -> None:
        """Rebalance the routed experts over the devices now, from the routing load since the
        last rebalance (needs parallel={..., "eplb": {...}}); the weights move, nothing
        recompiles, and no output changes."""
        self.engine.rebalance_experts().result()

    @property
    def prefix_cache_stats(self):
        """Prefix-cache counters (hits, reused and replayed tokens, cached blocks), or None
        when prefix caching is off."""
        return self.engine.scheduler.prefix_stats()

    @property
    def kv_tier_stats(self):
        """The KV tiers' reports by tier ("host", "disk": counters and prefetch latency,
        host/kv_tiers/prefetch.py), or None when no tier is configured. Puts and prefetches
        still queued on the tiers' worker are not in them yet (`engine.tiers.drain()`)."""
        return None if self.engine.tiers is None else self.engine.tiers.stats()

    @property
    def spec_metrics(self):
        """Speculative decoding counters summed over the requests this LLM finished."""
        return self._spec_totals


def _children(p: SamplingParams) -> list[SamplingParams]:
    """The requests a prompt runs as: best_of (or n) of them, seeded seed + i as vLLM's when
    the prompt has a seed; best_of > n ranks them by cumulative logprob, so they compute it."""
    count = p.best_of or p.n
    if count == 1:
        return [p]
    logprobs = 0 if p.logprobs is None and count > p.n else p.logprobs
    return [dataclasses.replace(p, n=1, best_of=None, prompt_logprobs=None, logprobs=logprobs,
                                seed=None if p.seed is None else (p.seed + i) % 2**32)
            for i in range(count)]


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
