"""The Ascend backend's engine: the JAX engine's host side (scheduler, plan builder, stop
handling, postprocess) unchanged, driving the torch step (step.py) synchronously: schedule,
build the plan, run the step, postprocess its output.

Start-up checks the features the options turn on against the platform table
(deepinfer_jax/config/platforms.py): batch-invariant mode fails there with an
UnsupportedFeatureError naming the feature and "ascend". Speculative steps (the MTP verify
and draft, speculative.py) run where the scheduler plans them, and the prefix cache's
snapshot copies (snapshots.py) around the steps that ask for them; constrained requests get
the grammar masks of the host's matchers (host/grammar.py) in the plan."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from ascend_backend.device import torch_device
from ascend_backend.model.state import init_state
from ascend_backend.snapshots import SnapshotPool
from ascend_backend.speculative import spec_step
from ascend_backend.step import step
from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.host import HostOptions
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.platforms import UnsupportedFeatureError, require_features
from deepinfer_jax.config.speculative import SpeculativeConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config
from deepinfer_jax.host.buckets import token_bucket
from deepinfer_jax.host.grammar import StructuredOutputs, grammar_spec
from deepinfer_jax.host.plan_builder import build_plan, suppress_stops
from deepinfer_jax.host.request import InvalidRequestError, Request, SamplingParams
from deepinfer_jax.host.scheduler import Scheduler
from deepinfer_jax.host.stop_strings import StopStrings
from deepinfer_jax.host.tokenizer import TextTokenizer

PLATFORM = "ascend"


def compiled_matcher(structured: StructuredOutputs, spec):
    """A matcher for the grammar `spec`, waiting for its compile (GrammarError if it fails)."""
    matcher = structured.lookup(spec)
    while matcher is StructuredOutputs.PENDING:
        for done, error in structured.poll(wait_s=0.05):
            if done == spec and error is not None:
                raise error
        matcher = structured.lookup(spec)
    return matcher


def requested_features(step_cfg: StepConfig) -> list[str]:
    """The platform-gated features a step configuration turns on."""
    wanted = {"batch_invariant": step_cfg.batch_invariant,
              "draft_token_map": (step_cfg.speculative is not None
                                  and step_cfg.speculative.draft_token_map is not None)}
    return [feature for feature, on in wanted.items() if on]


def step_config(cfg: ModelConfig, *, max_num_seqs: int, max_model_len: int, page_size: int,
                num_pages: int, max_num_batched_tokens: int, token_buckets: tuple[int, ...],
                max_logprobs: int = 20, batch_invariant: bool = False,
                speculative: SpeculativeConfig | None = None,
                enable_prefix_caching: bool = False, num_snapshots: int | None = None
                ) -> StepConfig:
    """The step's shapes for the torch backend (no compiled buckets: torch runs any shape,
    but the plan still comes in the host's buckets, so both backends see the same plans).
    num_snapshots: the prefix cache's snapshot pool (None: 4 per slot, as the JAX engine)."""
    return StepConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      page_size=page_size, num_pages=num_pages,
                      max_blocks_per_seq=-(-max_model_len // page_size),
                      max_num_batched_tokens=max_num_batched_tokens,
                      token_buckets=tuple(token_buckets), max_logprobs=max_logprobs,
                      vocab_size=cfg.vocab_size, speculative=speculative,
                      compute=ComputeConfig(batch_invariant=batch_invariant),
                      enable_prefix_caching=enable_prefix_caching,
                      num_snapshots=((num_snapshots or 4 * max_num_seqs)
                                     if enable_prefix_caching else 0))


def check_supported(cfg: ModelConfig, step_cfg: StepConfig) -> None:
    """UnsupportedFeatureError for what the platform table refuses on Ascend (start-up)."""
    if isinstance(cfg, V41Config):       # only DeepSeek-V4's model is written in torch
        raise UnsupportedFeatureError("deepseek_v41", PLATFORM)
    require_features(PLATFORM, requested_features(step_cfg))


class AscendEngine:
    # what the LLM's host loop reads of an engine (deepinfer_jax/api/llm.py): no device
    # memory plan (the pool follows the shapes) and no KV tiers on this backend
    memory_plan = None
    tiers = None
    num_steps = 0           # steps run (the server's metrics), counted per engine from here

    def __init__(self, cfg: ModelConfig, params, step_cfg: StepConfig, *,
                 device: str = "cpu", seed: int = 0, tokenizer: TextTokenizer | None = None,
                 host: HostOptions | None = None):
        """params: the tree of params.py (on `device`); device "cpu" or "npu[:i]";
        tokenizer: the model's, for structured output and stop strings (None: such requests
        are refused); host: the host options the LLM reports (llm.host_options)."""
        check_supported(cfg, step_cfg)
        if step_cfg.spec_tokens and params is not None and not params.mtp:
            raise EngineConfigError("speculative decoding needs the checkpoint's MTP weights "
                                    "(mtp.* tensors); this checkpoint has none")
        self.cfg, self.params, self.step_cfg, self.host = cfg, params, step_cfg, host
        dtype = params.embed.dtype if params is not None else torch.float32
        self.state = init_state(cfg, step_cfg, torch_device(device), dtype)
        self.scheduler = Scheduler(step_cfg, cfg.eos_token_ids)
        self.snapshots = (SnapshotPool(self.state, step_cfg.num_snapshots)
                          if step_cfg.enable_prefix_caching else None)
        self._arrivals, self._ids = itertools.count(), itertools.count()
        self._seeds = np.random.default_rng(seed)
        self.tokenizer = tokenizer
        self.structured = (StructuredOutputs(tokenizer.path, cfg.vocab_size, cfg.eos_token_ids)
                           if tokenizer is not None and cfg.eos_token_ids else None)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Request:
        """Queue a request; a constrained one's grammar is compiled first (GrammarError if it
        does not compile), where the JAX engine queues it until its compile finishes."""
        problems = params.problems(self.cfg.vocab_size, self.step_cfg.max_logprobs,
                                   self.structured is not None)
        # what the LLM layer does (n, best_of: one request each) or needs the JAX model's
        # reference forward (prompt_logprobs): refused here, not ignored
        unsupported = {"n": params.n != 1,
                       "best_of": params.best_of is not None,
                       "prompt_logprobs": params.prompt_logprobs is not None}
        problems += [f"{name} is not supported by the Ascend engine yet"
                     for name, asked in unsupported.items() if asked]
        if problems:
            raise InvalidRequestError("; ".join(problems))
        seed = params.seed if params.seed is not None else int(self._seeds.integers(2**32))
        # the stop-string search runs in the shared host's output checks, as on the JAX engine
        stop_strings = StopStrings(self.tokenizer.decoder(params.skip_special_tokens),
                                   params.stop) if params.stop else None
        request = Request(request_id, list(prompt), params, next(self._arrivals), seed=seed,
                          stop_strings=stop_strings)
        spec = grammar_spec(params) if self.structured is not None else None
        if spec is not None:
            request.matcher = compiled_matcher(self.structured, spec)
        self.scheduler.add(request)
        return request

    def abort(self, request_id: str) -> Request | None:
        return self.scheduler.abort(request_id)

    def rebalance_experts(self):
        raise EngineConfigError("expert load balancing needs a device mesh, which the Ascend "
                                "backend does not have")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def num_awaiting_grammar(self) -> int:
        """Requests queued until their grammar compiles: none here (add_request compiles
        it before queueing); the server's engine loop reports the JAX engine's count."""
        return 0

    def step(self) -> list[Request]:
        """One step: schedule, run, postprocess -> the requests that received tokens."""
        decision = self.scheduler.schedule()
        if not decision.seqs:
            return []
        self.num_steps += 1
        plan = build_plan(decision, token_bucket(self.step_cfg.token_buckets,
                                                 decision.num_tokens), self.step_cfg)
        # token bitmasks of the constrained rows that sample (their matchers have seen every
        # token so far: the loop is synchronous), then min_tokens
        rows = [(seq.request.matcher, row) for row, seq in enumerate(decision.seqs)
                if seq.samples and seq.request.matcher is not None]
        if rows:
            self.structured.fill_masks(rows, plan.allowed)
        suppress_stops(plan, decision, self.cfg.eos_token_ids)
        if decision.restores:
            self.snapshots.restore(self.state, decision.restores)
        run = spec_step if decision.speculative else step
        self.state, output = run(self.params, self.state, plan, cfg=self.cfg,
                                 step_cfg=self.step_cfg)
        if decision.saves:
            self.snapshots.save(self.state, decision.saves)
        return self.scheduler.postprocess(decision, output)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Every prompt to completion (one SamplingParams for all, or one each) -> its request
        (tokens in `generated`), in prompt order."""
        each = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.add_request(str(next(self._ids)), p, q)
                    for p, q in zip(prompts, each, strict=True)]
        while self.has_unfinished():
            self.step()
        return requests
