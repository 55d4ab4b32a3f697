"""EngineConfig: the engine's options as a user gives them (LLM(...)'s keyword arguments).

`resolve()` turns them into the StepConfig of one model on one device and `host_options()`
into the HostOptions, once, at start-up (config/options.py says in which order arguments,
DEEPINFER_* variables and the device's defaults count).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from deepinfer_jax.config import options
from deepinfer_jax.config.compute import KernelChoices
from deepinfer_jax.config.distributed import DistributedConfig
from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.family import facts_of
from deepinfer_jax.config.host import HostOptions
from deepinfer_jax.config.kv_tiers import DEFAULT_RETENTION_S, KVTierConfig
from deepinfer_jax.config.memory import MemoryLimits
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.parallel import ParallelConfig
from deepinfer_jax.config.platforms import check_backend
from deepinfer_jax.config.prefix_replay import bounded_replay_tokens, check_prefix_replay
from deepinfer_jax.config.speculative import SpeculativeConfig
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import V41Config

# The default context when none is given: the model's own, up to this many tokens (a default
# that compiles and holds pages for a 1M-token context would surprise more than it helps).
DEFAULT_MAX_MODEL_LEN = 4096

# The shapes the shipped tiny model starts with: `LLM()`, `make demo` and the `deepinfer`
# command share them, so that one compile (two token buckets, 16 and 32) serves all three.
QUICKSTART_SHAPES = {"max_num_seqs": 4, "max_model_len": 512, "max_num_batched_tokens": 32}

__all__ = ["DEFAULT_MAX_MODEL_LEN", "EngineConfig", "EngineConfigError", "HostOptions",
           "QUICKSTART_SHAPES", "SpeculativeConfig", "StepConfig"]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # which engine runs the steps: "jax" (NVIDIA GPUs, the CPU) or "ascend" (torch/torch_npu,
    # ascend_backend/); None: DEEPINFER_BACKEND, else "jax" (config/platforms.py)
    backend: str | None = None
    max_num_seqs: int = 16               # state slots: sequences resident at once
    # prompt + generated tokens per sequence (None: the model's max_position_embeddings,
    # capped at DEFAULT_MAX_MODEL_LEN, as vLLM derives it from the model)
    max_model_len: int | None = None
    page_size: int | None = None         # tokens per page of compressed rows (None: derived)
    # page pool size (None: planned from the device's memory, config/memory.py; where that is
    # not known, every slot can reach max_model_len). A stated pool must fit too.
    num_pages: int | None = None
    # The share of a device's memory for weights, activations and the cache (vLLM's name;
    # None: DEEPINFER_GPU_MEMORY_UTILIZATION, else 0.9), and the device's memory in GiB
    # (None: DEEPINFER_DEVICE_MEMORY_GIB, else what the device reports; the CPU reports none)
    gpu_memory_utilization: float | None = None
    device_memory_gib: float | None = None
    max_num_batched_tokens: int = 256    # chunked-prefill budget: tokens per step
    # None: powers of two up to the budget. A step never feeds more than the budget (drafts
    # included), so declared buckets past the first that holds it are dropped: none could be
    # chosen, and each would cost a compile and size the memory plan's activations
    token_buckets: tuple[int, ...] | None = None
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
    # The device mesh: {"dp": .., "ep": .., "tp": .., "cp": ..} (config/parallel.py); None: one
    # device
    parallel: dict | ParallelConfig | None = None
    # One engine over several processes: {"coordinator_address": "host:port",
    # "num_processes": n, "process_id": i} (config/distributed.py); None: this process alone
    distributed: dict | DistributedConfig | None = None
    enable_prefix_caching: bool = False
    num_prefix_snapshots: int | None = None   # snapshot pool (None: 4 per slot)
    # a hit restores the window rings from snapshots ("exact"), or rebuilds them by replaying
    # the prefix's last swa_replay_tokens tokens over its cached rows ("bounded"; see
    # config/prefix_replay.py and docs/prefix_caching.md)
    prefix_replay: str = "exact"
    swa_replay_tokens: int = 140
    # Prefix-cache blocks kept below the device (config/kv_tiers.py; 0 bytes: no such tier):
    # in host memory, then in files under kv_disk_tier_dir, each for kv_retention_s after last use
    kv_host_tier_bytes: int = 0
    kv_disk_tier_dir: str | None = None
    kv_disk_tier_bytes: int = 0
    kv_retention_s: float = DEFAULT_RETENTION_S
    # DeepSeek-V4.1's Engram tables: "host" keeps them in host memory, the host gathers each
    # step's rows and the plan carries them to the device; "device" keeps them with the
    # weights, and the step hashes and gathers (so the loop may run asynchronously). None:
    # "host" (resolved_engram_tables says why)
    engram_tables: str | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise EngineConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError("max_num_batched_tokens must be >= max_num_seqs "
                                    "(every running sequence decodes one token per step)")
        object.__setattr__(self, "backend", check_backend(options.backend(self.backend)))
        if self.batch_invariant is None:
            object.__setattr__(self, "batch_invariant",
                               bool(options.flag("DEEPINFER_BATCH_INVARIANT")))
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.from_options(self.speculative_config))
        object.__setattr__(self, "parallel", ParallelConfig.from_options(self.parallel))
        object.__setattr__(self, "distributed",
                           DistributedConfig.from_options(self.distributed))
        if self.token_buckets is not None:
            buckets = tuple(sorted(set(self.token_buckets)))
            if buckets[-1] < self.max_num_batched_tokens or buckets[0] <= 0:
                raise EngineConfigError("token_buckets must be positive and reach "
                                        "max_num_batched_tokens")
            reach = next(i for i, b in enumerate(buckets) if b >= self.max_num_batched_tokens)
            object.__setattr__(self, "token_buckets", buckets[: reach + 1])
        if self.num_prefix_snapshots is not None and self.num_prefix_snapshots < 1:
            raise EngineConfigError("num_prefix_snapshots must be >= 1")
        check_prefix_replay(self)
        tiers = self.kv_tiers     # validates the tier options
        if tiers.enabled and not self.enable_prefix_caching:
            raise EngineConfigError("KV tiers keep prefix-cache blocks: they need "
                                    "enable_prefix_caching=True")
        if tiers.enabled and self.distributed is not None:
            # each process would write and read its own tier files
            raise EngineConfigError("KV tiers are not supported over several processes yet")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got "
                                    f"{self.gpu_memory_utilization}")
        if self.engram_tables not in (None, "host", "device"):
            raise EngineConfigError(f"engram_tables must be 'host' or 'device', got "
                                    f"{self.engram_tables!r}")
        if self.device_memory_gib is not None and self.device_memory_gib <= 0:
            raise EngineConfigError(f"device_memory_gib must be > 0, got {self.device_memory_gib}")

    def resolve(self, model: ModelConfig | V41Config, device: options.DeviceFacts = options.CPU,
                environ: Mapping[str, str] | None = None) -> StepConfig:
        """The step's configuration for this model on this device (arguments, then
        DEEPINFER_* variables, then the device's defaults)."""
        family = facts_of(model)
        no_mtp = family.no_mtp_reason(model)
        if self.speculative_config is not None and no_mtp is not None:
            raise EngineConfigError(no_mtp)
        rates = list(family.page_rates(model)) or [1]
        unit = math.lcm(*rates)
        page_size = self.page_size or unit * max(1, math.ceil(64 / unit))
        if page_size % unit:
            raise EngineConfigError(f"page_size {page_size} must be a multiple of every compress "
                                    f"rate {rates}")
        max_model_len = self.model_len(model)
        blocks = math.ceil(max_model_len / page_size)
        num_pages = self.num_pages if self.num_pages is not None else blocks * self.max_num_seqs
        if num_pages < 1:
            raise EngineConfigError("num_pages must be >= 1")
        buckets = self.token_buckets
        if buckets is None:
            buckets, b = [], 16
            while b < self.max_num_batched_tokens:
                buckets.append(b)
                b *= 2
            buckets = tuple(buckets + [self.max_num_batched_tokens])
        if self.speculative_config is not None and (
                self.max_num_batched_tokens < self.max_num_seqs * 2):
            raise EngineConfigError("with speculation, max_num_batched_tokens must leave room "
                                    "for drafts: at least 2 x max_num_seqs")
        compute = options.resolve_compute(device, formulation=self.step_formulation,
                                          kernels=self.kernels,
                                          batch_invariant=self.batch_invariant,
                                          invariant_tile=self.invariant_tile, environ=environ)
        self.parallel.check(model, device.device_count, device.process_count)
        compute = dataclasses.replace(compute, parallel=self.parallel)
        return StepConfig(
            max_num_seqs=self.max_num_seqs, max_model_len=max_model_len,
            page_size=page_size, num_pages=num_pages, max_blocks_per_seq=blocks,
            max_num_batched_tokens=self.max_num_batched_tokens, token_buckets=buckets,
            max_logprobs=min(self.max_logprobs, model.vocab_size), vocab_size=model.vocab_size,
            speculative=self.speculative_config, compute=compute,
            enable_prefix_caching=self.enable_prefix_caching, engram_shape=family.engram_shape(model),
            engram_row_dim=(model.engram.head_dim if self.resolved_engram_tables(model) == "host"
                            else 0),
            engram_lookback=(model.engram.max_ngram_size - 1
                             if self.resolved_engram_tables(model) == "device" else 0),
            num_snapshots=(self.num_prefix_snapshots or 4 * self.max_num_seqs)
            if self.enable_prefix_caching else 0, bounded_replay=bounded_replay_tokens(self))

    def memory(self, device: options.DeviceFacts = options.CPU,
               environ: Mapping[str, str] | None = None) -> MemoryLimits | None:
        """What the page pool is planned against (config/memory.py): None where the device's
        memory is neither stated nor reported, and the pool follows the shapes alone."""
        device_bytes = options.device_memory(self.device_memory_gib, device, environ)
        if device_bytes is None:
            return None
        utilization = options.memory_utilization(self.gpu_memory_utilization, environ)
        if not 0 < utilization <= 1:
            raise EngineConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
        stated = options.device_memory(self.device_memory_gib, options.CPU, environ)
        return MemoryLimits(device_bytes, utilization, self.num_pages, reported=stated is None)

    def resolved_engram_tables(self, model) -> str | None:
        """Where the model's Engram tables live (None: it has none). The default is the host
        for every model with Engram: the released tables are far too large for a device's
        memory beside the weights and the cache, a step needs only T x L_e x C of their rows,
        and one default (not one that follows the device's memory) keeps the compiled step
        the same on every machine; "device" is the choice for small models whose tables fit
        and for comparison."""
        if getattr(model, "engram", None) is None:
            return None
        return self.engram_tables or "host"

    @property
    def kv_tiers(self) -> KVTierConfig:
        return KVTierConfig(host_bytes=self.kv_host_tier_bytes, disk_dir=self.kv_disk_tier_dir,
                            disk_bytes=self.kv_disk_tier_bytes, retention_s=self.kv_retention_s)

    def model_len(self, model: ModelConfig) -> int:
        """max_model_len for this model: as given (at most the model's context), or the
        model's context capped at DEFAULT_MAX_MODEL_LEN."""
        if self.max_model_len is None:
            return min(DEFAULT_MAX_MODEL_LEN, model.max_position_embeddings)
        if self.max_model_len > model.max_position_embeddings:
            raise EngineConfigError(f"max_model_len {self.max_model_len} exceeds the model's "
                                    f"max_position_embeddings {model.max_position_embeddings}; "
                                    f"leave it unset to follow the model")
        return self.max_model_len

    def host_options(self, step: StepConfig, environ: Mapping[str, str] | None = None
                     ) -> HostOptions:
        return HostOptions(
            compilation_cache_dir=self.compilation_cache_dir, show_progress=self.show_progress,
            # the Engram hash (DeepSeek-V4.1) with host tables needs every fed token on the
            # host when it plans, and asynchronous scheduling feeds the last sampled one before
            # the host has read it (with device tables the step hashes); speculation over
            # data-parallel ranks reads each step's accepted counts before planning the next
            # (host/ranks.py books no speculative step at launch; one rank's does:
            # host/spec_booking.py)
            async_scheduling=(self.async_scheduling and not step.hashes_tokens
                              and not (step.speculative is not None
                                       and step.compute.parallel.dp > 1)),
            launch_thread=self.launch_thread, seed=self.seed,
            grammar_compile_timeout_s=self.grammar_compile_timeout_s,
            compile_threads=options.compile_threads(self.compile_threads, environ),
            step_cache=options.flag("DEEPINFER_STEP_CACHE", environ) is not False,
            kv_tiers=self.kv_tiers if self.kv_tiers.enabled else None)
