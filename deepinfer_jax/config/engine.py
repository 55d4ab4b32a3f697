"""EngineConfig: how the engine lays out its state and which shapes it compiles.

Every compiled step has a fixed shape: a token bucket T (flat tokens of the ragged batch) and
a sequence bucket N = min(T, max_num_seqs). All buckets are compiled at start-up.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from deepinfer_jax.config import options
from deepinfer_jax.config.compute import ComputeConfig, KernelChoices
from deepinfer_jax.config.model import ModelConfig


class EngineConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """MTP speculative decoding (vLLM's `speculative_config` shape).

    num_speculative_tokens: the most drafts per request and step (the MTP block is applied
    recursively); varlen: per-request draft lengths, drafting stops once the drafts'
    cumulative probability under the MTP block falls below confidence_threshold;
    verify_token_budget: the most draft tokens verified per step, shared by the decoding
    requests (each gets at most budget // requests), so speculation fades out as the batch
    grows and the step becomes compute-bound; past `budget` requests the engine runs its plain
    step.
    """

    method: str = "mtp"
    num_speculative_tokens: int = 5
    varlen: bool = True
    confidence_threshold: float = 0.3
    verify_token_budget: int = 32

    def __post_init__(self):
        if self.method != "mtp":
            raise EngineConfigError(f"speculative_config.method: only 'mtp', got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise EngineConfigError("speculative_config.num_speculative_tokens must be in [1, 16]")
        if not 0 <= self.confidence_threshold < 1:
            raise EngineConfigError("speculative_config.confidence_threshold must be in [0, 1)")
        if self.verify_token_budget < 1:
            raise EngineConfigError("speculative_config.verify_token_budget must be >= 1")

    @classmethod
    def from_options(cls, given) -> "SpeculativeConfig | None":
        """From LLM(speculative_config=...) or, when that is None, the environment
        (config/options.py)."""
        if isinstance(given, cls):
            return given
        if given is None:
            given = options.speculative_from_environment()
            if given is None:
                return None
        if not isinstance(given, dict):
            raise TypeError("speculative_config must be a dict or SpeculativeConfig")
        unknown = set(given) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown speculative_config option(s): {sorted(unknown)}")
        return cls(**given)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 16               # state slots: sequences resident at once
    max_model_len: int = 4096            # prompt + generated tokens per sequence
    page_size: int | None = None         # tokens per page of compressed rows (None: derived)
    num_pages: int | None = None         # page pool size (None: every slot can reach max_model_len)
    max_num_batched_tokens: int = 256    # chunked-prefill budget: tokens per step
    token_buckets: tuple[int, ...] | None = None   # None: powers of two up to the budget
    compilation_cache_dir: str | None = dataclasses.field(default_factory=options.default_cache_dir)
    show_progress: bool = True
    async_scheduling: bool = True        # plan step N+1 while step N runs
    # with async scheduling: each step's device calls on a worker thread (engine/launch.py), so
    # XLA's kernel launches overlap the loop's reading and planning
    launch_thread: bool = True
    seed: int = 0                        # draws the seeds of requests that give none
    max_logprobs: int = 20               # the most top logprobs a request may ask for
    grammar_compile_timeout_s: float = 10.0
    # None: the DEEPINFER_BATCH_INVARIANT environment variable (1 = on)
    batch_invariant: bool | None = None
    # MTP speculation: a dict (see SpeculativeConfig); None: the DEEPINFER_* variables
    speculative_config: dict | SpeculativeConfig | None = None
    # How the step computes (config/compute.py); None: DEEPINFER_* variables, then the
    # device's defaults (config/options.py). kernels: one implementation list for every
    # Pallas op, a dict op -> list, or a KernelChoices.
    kernels: str | tuple[str, ...] | dict | KernelChoices | None = None
    step_formulation: str | None = None     # "cpu" | "gpu"
    invariant_tile: int | None = None
    compile_threads: int | None = None      # buckets compiled at once at start-up
    # Prefix caching: sequences reuse the pages and slot snapshots of cached token blocks
    enable_prefix_caching: bool = False
    num_prefix_snapshots: int | None = None   # snapshot pool (None: 4 per slot)

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError("max_num_batched_tokens must be >= max_num_seqs "
                                    "(every running sequence decodes one token per step)")
        if self.batch_invariant is None:
            object.__setattr__(self, "batch_invariant",
                               bool(options.flag("DEEPINFER_BATCH_INVARIANT")))
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.from_options(self.speculative_config))
        if self.token_buckets is not None:
            buckets = tuple(sorted(set(self.token_buckets)))
            if buckets[-1] < self.max_num_batched_tokens or buckets[0] <= 0:
                raise EngineConfigError("token_buckets must be positive and reach "
                                        "max_num_batched_tokens")
            object.__setattr__(self, "token_buckets", buckets)
        if self.num_prefix_snapshots is not None and self.num_prefix_snapshots < 1:
            raise EngineConfigError("num_prefix_snapshots must be >= 1")

    def resolve(self, model: ModelConfig, device: options.DeviceFacts = options.CPU,
                environ: Mapping[str, str] | None = None) -> "ResolvedEngineConfig":
        return ResolvedEngineConfig.build(self, model, device, environ)


@dataclasses.dataclass(frozen=True)
class ResolvedEngineConfig:
    """EngineConfig with every derived size fixed for one model (hashable: a static jit arg)."""

    max_num_seqs: int
    max_model_len: int
    page_size: int
    num_pages: int
    max_blocks_per_seq: int
    max_num_batched_tokens: int
    token_buckets: tuple[int, ...]
    compilation_cache_dir: str | None
    show_progress: bool
    async_scheduling: bool
    launch_thread: bool
    seed: int
    max_logprobs: int
    grammar_compile_timeout_s: float
    vocab_size: int
    speculative: SpeculativeConfig | None
    compute: ComputeConfig
    compile_threads: int
    enable_prefix_caching: bool = False
    num_snapshots: int = 0            # snapshot pool of the prefix cache (0: no cache)

    @property
    def batch_invariant(self) -> bool:
        return self.compute.batch_invariant

    @property
    def spec_tokens(self) -> int:
        """Drafts per request and step at most (0: no speculation)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    @classmethod
    def build(cls, ec: EngineConfig, model: ModelConfig, device: options.DeviceFacts,
              environ: Mapping[str, str] | None = None) -> "ResolvedEngineConfig":
        if ec.speculative_config is not None and model.num_mtp_layers == 0:
            raise EngineConfigError("speculative decoding with MTP needs a model with an MTP "
                                    "block (num_nextn_predict_layers > 0)")
        rates = sorted({model.compress_rate(k) for k in model.layer_types} - {0}) or [1]
        unit = math.lcm(*rates)
        page_size = ec.page_size or unit * max(1, math.ceil(64 / unit))
        if page_size % unit:
            raise EngineConfigError(f"page_size {page_size} must be a multiple of every compress "
                                    f"rate {rates}")
        if ec.max_model_len > model.max_position_embeddings:
            raise EngineConfigError(f"max_model_len {ec.max_model_len} exceeds the model's "
                                    f"max_position_embeddings {model.max_position_embeddings}")
        blocks = math.ceil(ec.max_model_len / page_size)
        num_pages = ec.num_pages if ec.num_pages is not None else blocks * ec.max_num_seqs
        if num_pages < 1:
            raise EngineConfigError("num_pages must be >= 1")
        buckets = ec.token_buckets
        if buckets is None:
            buckets, b = [], 16
            while b < ec.max_num_batched_tokens:
                buckets.append(b)
                b *= 2
            buckets = tuple(buckets + [ec.max_num_batched_tokens])
        if ec.speculative_config is not None and (
                ec.max_num_batched_tokens < ec.max_num_seqs * 2):
            raise EngineConfigError("with speculation, max_num_batched_tokens must leave room "
                                    "for drafts: at least 2 x max_num_seqs")
        compute = options.resolve_compute(device, formulation=ec.step_formulation,
                                          kernels=ec.kernels, batch_invariant=ec.batch_invariant,
                                          invariant_tile=ec.invariant_tile, environ=environ)
        return cls(max_num_seqs=ec.max_num_seqs, max_model_len=ec.max_model_len,
                   page_size=page_size, num_pages=num_pages, max_blocks_per_seq=blocks,
                   max_num_batched_tokens=ec.max_num_batched_tokens, token_buckets=buckets,
                   compilation_cache_dir=ec.compilation_cache_dir, show_progress=ec.show_progress,
                   # speculation reads each step's accepted counts before planning the next
                   async_scheduling=ec.async_scheduling and ec.speculative_config is None,
                   launch_thread=ec.launch_thread,
                   seed=ec.seed,
                   max_logprobs=min(ec.max_logprobs, model.vocab_size),
                   grammar_compile_timeout_s=ec.grammar_compile_timeout_s,
                   vocab_size=model.vocab_size,
                   speculative=ec.speculative_config, compute=compute,
                   compile_threads=options.compile_threads(ec.compile_threads,
                                                           compute.formulation,
                                                           os.cpu_count() or 1, environ),
                   enable_prefix_caching=ec.enable_prefix_caching,
                   num_snapshots=(ec.num_prefix_snapshots or 4 * ec.max_num_seqs)
                   if ec.enable_prefix_caching else 0)

    def seq_bucket(self, token_bucket: int) -> int:
        return min(token_bucket, self.max_num_seqs)

    @property
    def mask_words(self) -> int:
        """int32 words of a token bitmask row."""
        return -(-self.vocab_size // 32)

    def rows_per_page(self, rate: int) -> int:
        return self.page_size // rate

    def max_rows(self, rate: int) -> int:
        """Compressed rows a sequence can reach (positions < max_model_len)."""
        return self.max_model_len // rate
