"""Device memory as a planned quantity: what the state cache costs, and how many pages fit.

The device holds, besides XLA's runtime: the weights, the step's activations (XLA's temporary
buffers of the largest compiled bucket) and the state cache (model/state.py). The cache has a
part that follows the page pool and a part fixed by the slots:

* per page, across every layer: each compressed layer's `page_size // m` rows of `head_dim`,
  and a CSA layer's as many indexer keys of `index_head_dim` (compute dtype);
* per slot: every layer's window ring (`sliding_window + spare` rows, compute dtype), each
  compressed layer's compressor tails (float32 kv and score rings; the indexer's too on CSA
  layers), the MTP block's window with speculation, and the sampler's per-slot vocabulary
  rows (a bool prompt mask and int32 output counts) and last token;
* with prefix caching, `num_snapshots` snapshots of a slot's rings at a block end, compacted
  to what a later token reads (device/snapshot_layout.py).

`plan_pool` gives the pool from the memory left after weights, activations and the slots'
state; `cache_bytes` is checked against `init_state`'s real pytree in the tests, so that the
two descriptions of the layout cannot drift apart. Pure Python: no jax.
"""

from __future__ import annotations

import dataclasses
import math

from deepinfer_jax.config.errors import InsufficientMemoryError
from deepinfer_jax.config.model import AttentionKind, ModelConfig
from deepinfer_jax.config.step import StepConfig

GiB = 2**30
_F32, _I32 = 4, 4


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / GiB:.4f} GiB"


# ---- the cache's layout in bytes ------------------------------------------------------------

def page_bytes(cfg: ModelConfig, page_size: int, dtype_bytes: int = 2) -> int:
    """Bytes one page of the pool holds across all layers (its compressed rows and, on CSA
    layers, indexer keys)."""
    total = 0
    for kind in cfg.layer_types:
        if kind is AttentionKind.SLIDING:
            continue
        rows = page_size // cfg.compress_rate(kind)
        total += rows * cfg.head_dim * dtype_bytes
        if kind is AttentionKind.CSA:
            total += rows * cfg.index_head_dim * dtype_bytes
    return total


def _tail_bytes(rate: int, overlap: bool, dim: int, spare: int) -> int:
    ring, width = (2 * rate, 2 * dim) if overlap else (rate, dim)
    return 2 * (ring + spare) * width * _F32          # kv and score rings


def slot_ring_bytes(cfg: ModelConfig, spec_tokens: int = 0, dtype_bytes: int = 2) -> int:
    """One slot's rings in the state: every layer's window and compressor tails, the MTP
    block's window with speculation."""
    window = (cfg.sliding_window + spec_tokens) * cfg.head_dim * dtype_bytes
    total = 0
    for kind in cfg.layer_types:
        total += window
        if kind is not AttentionKind.SLIDING:
            rate = cfg.compress_rate(kind)
            total += _tail_bytes(rate, kind is AttentionKind.CSA, cfg.head_dim, spec_tokens)
        if kind is AttentionKind.CSA:
            total += _tail_bytes(cfg.compress_rate_csa, True, cfg.index_head_dim, spec_tokens)
    return total + (window if spec_tokens else 0)            # the MTP block's window


def snapshot_bytes(cfg: ModelConfig, spec_tokens: int = 0, dtype_bytes: int = 2,
                   windows: bool = True) -> int:
    """One prefix-cache snapshot (device/snapshot_layout.py): every window ring (none for a
    bounded prefix replay) and, per CSA layer, its and its indexer's last closed block's first
    halves (float32 kv and score, m rows of d)."""
    window = (cfg.sliding_window + spec_tokens) * cfg.head_dim * dtype_bytes if windows else 0
    halves = 2 * cfg.compress_rate_csa * (cfg.head_dim + cfg.index_head_dim) * _F32
    total = sum(window + (halves if kind is AttentionKind.CSA else 0) for kind in cfg.layer_types)
    return total + (window if spec_tokens else 0)            # the MTP block's window


def slot_bytes(cfg: ModelConfig, spec_tokens: int = 0, dtype_bytes: int = 2) -> int:
    """One slot's state: its rings, last token, prompt mask (bool) and output counts (i32);
    with speculation its SpecCarry (model/state.py: accepted, k drafts, their count, i32)."""
    carry = (2 + spec_tokens) * _I32 if spec_tokens else 0
    return (slot_ring_bytes(cfg, spec_tokens, dtype_bytes) + _I32
            + cfg.vocab_size * (1 + _I32) + carry)


def fixed_cache_bytes(cfg: ModelConfig, step_cfg: StepConfig, dtype_bytes: int = 2) -> int:
    """The cache's bytes that do not follow the pool: every slot's state and the prefix
    cache's snapshots."""
    spare = step_cfg.spec_tokens
    return (step_cfg.max_num_seqs * slot_bytes(cfg, spare, dtype_bytes)
            + step_cfg.num_snapshots * snapshot_bytes(cfg, spare, dtype_bytes,
                                                      windows=not step_cfg.bounded_replay))


def cache_bytes(cfg: ModelConfig, step_cfg: StepConfig, dtype_bytes: int = 2) -> int:
    """Bytes of the whole state cache (pool, slots, snapshots) for `step_cfg`'s shapes."""
    return (step_cfg.num_pages * page_bytes(cfg, step_cfg.page_size, dtype_bytes)
            + fixed_cache_bytes(cfg, step_cfg, dtype_bytes))


# ---- activations, estimated -----------------------------------------------------------------

def activation_estimate(cfg: ModelConfig, step_cfg: StepConfig) -> int:
    """An estimate of the largest bucket's activation peak (T tokens, N = min(T, max_num_seqs)
    sampled rows), for planning without compiling: one layer's temporaries are live at a
    time (XLA reuses them across layers), per token

        3 hc D x 4          the mHC residual streams (f32): input, mixed, output
      + 2 H hd x 2          queries and the attention output (bf16)
      + (W + C) hd x 2      the key rows gathered: window W, selected rows C (bf16)
      + H (W + C) x 4       attention logits (f32); C = max(index_topk, max_model_len / m_hca)
      + IH (L / m_csa) x 4  the indexer's scores over every compressed row (f32)
      + K (3 I + D) x 4     routed experts: gate | up, their product, weighted outputs (f32)

    and per sampled row 3 V x 4 (logits, probabilities, sort keys). The engine measures the
    compiled step instead (engine/memory_plan.py); the CPU formulation upcasts weights in
    its temporaries and measures far above this estimate."""
    t = max(step_cfg.token_buckets)
    n = step_cfg.seq_bucket(t)
    length, hd, w = step_cfg.max_model_len, cfg.head_dim, cfg.sliding_window
    selected = max(cfg.index_topk, length // cfg.compress_rate_hca)
    per_token = (3 * cfg.hc_mult * cfg.hidden_size * _F32
                 + 2 * cfg.num_heads * hd * 2
                 + (w + selected) * hd * 2
                 + cfg.num_heads * (w + selected) * _F32
                 + cfg.index_n_heads * (length // cfg.compress_rate_csa) * _F32
                 + cfg.num_experts_per_tok * (3 * cfg.moe_intermediate_size + cfg.hidden_size)
                 * _F32)
    return t * per_token + n * 3 * cfg.vocab_size * _F32


# ---- the plan -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MemoryLimits:
    """What the pool is planned against, resolved once (EngineConfig.memory)."""

    device_bytes: int             # one device's memory for the engine
    utilization: float            # the share of it weights, activations and cache may take
    num_pages: int | None = None  # a pool the user stated (it must fit), else None: planned
    # device_bytes is the allocator's own limit (not stated): what it already holds is then
    # measured against it (MemoryPlan.unusable)
    reported: bool = False

    @property
    def budget(self) -> int:
        return int(self.device_bytes * self.utilization)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """One device's memory: what is resident and how many pages the pool gets.

    Invariant when `device_bytes` is known: weights + unusable + activations + cache <= budget.
    """

    weights: int                  # bytes of the parameters on this device
    activations: int              # the largest bucket's activation peak
    activations_measured: bool    # XLA's memory analysis (True) or activation_estimate
    fixed_cache: int              # slots' state and snapshots
    page_bytes: int
    page_size: int                # tokens a page covers
    pages: int                    # the pool
    max_num_seqs: int
    max_model_len: int
    blocks_per_seq: int           # pages one sequence of max_model_len needs
    device_bytes: int | None      # None: not known (the CPU, unless stated)
    utilization: float
    devices: int = 1
    notes: tuple[str, ...] = ()   # the layout's assumptions, printed with the plan
    # weights held in host memory instead (DeepSeek-V4.1's Engram tables with
    # engram_tables="host"): not in `weights`, not against the device's budget
    host_weights: int = 0
    # Device memory the allocator held, when the plan was made, outside its largest free block
    # beyond the weights: other arrays and the holes freed buffers left (a weight loader's
    # staging, a random draw's temporaries). The state and the step's temporaries, one block
    # of XLA's, cannot use it. Measured where the allocator reports it, else 0.
    unusable: int = 0

    @property
    def budget(self) -> int | None:
        return None if self.device_bytes is None else int(self.device_bytes * self.utilization)

    @property
    def cache(self) -> int:
        return self.fixed_cache + self.pages * self.page_bytes

    @property
    def tokens(self) -> int:
        """Token positions the pool covers (across all sequences)."""
        return self.pages * self.page_size

    @property
    def total(self) -> int:
        return self.weights + self.unusable + self.activations + self.cache

    @property
    def full_reach_pages(self) -> int:
        """Pages for every slot at max_model_len at once."""
        return self.max_num_seqs * self.blocks_per_seq

    @property
    def fits(self) -> bool | None:
        """Whether one sequence of max_model_len fits (None: device memory not known)."""
        return None if self.budget is None else (
            self.pages >= self.blocks_per_seq and self.total <= self.budget)

    def needed(self, pages: int) -> int:
        """Device bytes (before utilization) that `pages` pages need."""
        need = (self.weights + self.unusable + self.activations + self.fixed_cache
                + pages * self.page_bytes)
        return math.ceil(need / self.utilization)

    def format(self) -> str:
        act = "measured" if self.activations_measured else "estimate"
        lines = [f"devices          {self.devices}" + (" (per-device figures below)"
                                                          if self.devices > 1 else ""),
                 f"weights          {_gib(self.weights)}",
                 *([f"host memory      {_gib(self.host_weights)} (Engram tables, not on the "
                    f"device; each step's rows go with its plan)"] if self.host_weights else []),
                 *([f"unusable         {_gib(self.unusable)} (held outside the allocator's "
                    f"largest free block)"] if self.unusable else []),
                 f"activations      {_gib(self.activations)} ({act}, largest token bucket)",
                 f"slot state       {_gib(self.fixed_cache)} ({self.max_num_seqs} slots)",
                 f"page             {self.page_bytes / 2**20:.3f} MiB for {self.page_size} "
                 f"tokens; {self.blocks_per_seq} pages per sequence of {self.max_model_len}"]
        if self.budget is None:
            lines += [f"cache            {_gib(self.cache)} ({self.pages} pages, "
                      f"{self.tokens} tokens: every slot at max_model_len)",
                      f"device memory    not stated: needs {_gib(self.needed(self.blocks_per_seq))}"
                      f" for one sequence, {_gib(self.needed(self.full_reach_pages))} for all "
                      f"{self.max_num_seqs} at max_model_len (at utilization "
                      f"{self.utilization:g})"]
        else:
            lines += [f"cache            {_gib(self.cache)} ({self.pages} pages, "
                      f"{self.tokens} tokens, {self.pages / self.blocks_per_seq:.1f} sequences "
                      f"of max_model_len)",
                      f"budget           {_gib(self.budget)} ({_gib(self.device_bytes)} x "
                      f"utilization {self.utilization:g})",
                      f"total            {_gib(self.total)}",
                      f"fits             {'yes' if self.fits else 'no'}"]
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


def check_weights(weights: int, device_bytes: int, utilization: float, what: str = "") -> None:
    """Weights alone above the budget: the error before anything is compiled."""
    budget = int(device_bytes * utilization)
    if weights > budget:
        raise InsufficientMemoryError(
            f"the weights{what} need {_gib(weights)}, more than the {_gib(budget)} the engine "
            f"may use ({_gib(device_bytes)} device memory x gpu_memory_utilization "
            f"{utilization:g}): use quantized weights, more devices, or a device with more "
            f"memory")


def plan_pool(plan: MemoryPlan, given_pages: int | None = None) -> MemoryPlan:
    """The plan with its pool: `given_pages` if stated (it must fit), else as many pages as
    the budget leaves, at most every slot at max_model_len (more would never be used without
    the prefix cache) and at least one sequence of max_model_len. Raises
    InsufficientMemoryError saying what is resident and what to change."""
    if plan.budget is None:   # nothing known: the pool as stated, or every slot's reach
        return dataclasses.replace(plan, pages=given_pages or plan.full_reach_pages)
    check_weights(plan.weights, plan.device_bytes, plan.utilization)
    fit = pages_that_fit(plan)
    planned = best_pool(plan) if given_pages is None else dataclasses.replace(plan,
                                                                               pages=given_pages)
    # a stated pool only has to fit (a smaller one than a full sequence is the user's call:
    # the engine refuses requests longer than it); a planned one must hold one sequence
    if planned.pages > fit or (given_pages is None and planned.pages < plan.blocks_per_seq):
        # the message shows what the pool would need: as stated, or one full sequence
        wanted = dataclasses.replace(plan, pages=given_pages or plan.blocks_per_seq)
        raise InsufficientMemoryError(_does_not_fit(wanted, fit, given_pages))
    return planned


def pages_that_fit(plan: MemoryPlan) -> int:
    """Pages the budget leaves after weights, activations and the slots' state (>= 0)."""
    left = plan.budget - plan.weights - plan.unusable - plan.activations - plan.fixed_cache
    return max(left, 0) // plan.page_bytes if plan.page_bytes else plan.full_reach_pages


def best_pool(plan: MemoryPlan) -> MemoryPlan:
    """The plan with as many pages as fit, at most every slot at max_model_len (every slot's
    reach where the device's memory is not known); it may not fit (`plan.fits`)."""
    if plan.budget is None:
        return dataclasses.replace(plan, pages=plan.full_reach_pages)
    return dataclasses.replace(plan, pages=min(pages_that_fit(plan), plan.full_reach_pages))


def _does_not_fit(plan: MemoryPlan, fit: int, given_pages: int | None) -> str:
    act = "measured" if plan.activations_measured else "estimated"
    want = (f"num_pages={given_pages}" if given_pages is not None else
            f"one sequence of max_model_len={plan.max_model_len} ({plan.blocks_per_seq} pages)")
    unusable = (f"unusable {_gib(plan.unusable)} (held outside the allocator's largest free "
                f"block) + " if plan.unusable else "")
    return (f"the model does not fit with {want}: weights {_gib(plan.weights)} + {unusable}"
            f"activations "
            f"{_gib(plan.activations)} ({act}) + cache {_gib(plan.cache)} "
            f"({plan.pages} pages of {plan.page_bytes / 2**20:.2f} MiB and "
            f"{_gib(plan.fixed_cache)} for {plan.max_num_seqs} slots) = {_gib(plan.total)} > "
            f"{_gib(plan.budget)} ({_gib(plan.device_bytes)} device memory x "
            f"gpu_memory_utilization {plan.utilization:g}; {fit} pages fit). Use fewer "
            f"max_num_seqs or a shorter max_model_len (fewer max_num_batched_tokens for the "
            f"activations), fewer num_pages, quantized weights, more devices, or a higher "
            f"gpu_memory_utilization")
