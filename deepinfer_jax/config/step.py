"""StepConfig: the shapes a compiled step has and how it computes, fixed for one model.

Every compiled step has a fixed shape: a token bucket T (flat tokens of the ragged batch) and
a sequence bucket N = min(T, max_num_seqs). All buckets are compiled at start-up.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.config.speculative import SpeculativeConfig


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """What the compiled step depends on: every shape fixed for one model, the modes and how
    the step computes (hashable: a static jit argument). The host reads its shapes too (the
    scheduler plans within them); options only the host reads are HostOptions."""

    max_num_seqs: int
    max_model_len: int
    page_size: int
    num_pages: int
    max_blocks_per_seq: int
    max_num_batched_tokens: int
    token_buckets: tuple[int, ...]
    max_logprobs: int
    vocab_size: int
    speculative: SpeculativeConfig | None
    compute: ComputeConfig
    enable_prefix_caching: bool = False
    num_snapshots: int = 0            # snapshot pool of the prefix cache (0: no cache)
    # prefix hits rebuild the window rings by replaying this many cached tokens, and snapshots
    # keep no windows (config/prefix_replay.py); 0: exact snapshots
    bounded_replay: int = 0
    # (L_e, C): the Engram row ids of each fed token; (0, 0) for a model without Engram
    engram_shape: tuple[int, int] = (0, 0)
    # Where they are hashed. 0: by the host, and the plan carries them (BatchPlan.engram_ids).
    # Otherwise by the step (model/v41/engram_device.py, with the tables on the device), and
    # the plan carries each row's `engram_lookback` (max_ngram - 1) tokens before its span
    # (BatchPlan.engram_before); the plan's other field is then empty.
    engram_lookback: int = 0
    # Engram tables in host memory (EngineConfig.engram_tables="host"): the host gathers each
    # fed token's table rows and the plan carries them (BatchPlan.engram_rows [T, L_e, C, ed]
    # in `engram_row_dtype`, the tables' own); 0: the tables are device weights, gathered in
    # the step, and the plan's rows field is empty
    engram_row_dim: int = 0
    engram_row_dtype: str = "float32"

    @property
    def batch_invariant(self) -> bool:
        return self.compute.batch_invariant

    @property
    def hashes_tokens(self) -> bool:
        """The host hashes every fed token (Engram): it must know them all when it plans."""
        return self.engram_shape[0] > 0 and not self.engram_lookback

    @property
    def plan_engram_shape(self) -> tuple[int, int]:
        """(L_e, C) of the ids a plan token carries: (0, 0) where the step hashes."""
        return self.engram_shape if self.hashes_tokens else (0, 0)

    @property
    def engram_rows_on_host(self) -> bool:
        return self.engram_row_dim > 0

    @property
    def engram_row_np_dtype(self) -> np.dtype:
        """The rows' numpy dtype (bfloat16 from ml_dtypes, numpy's home for it; no jax)."""
        name = self.engram_row_dtype
        if name in np.sctypeDict:           # float32, float16: numpy's own
            return np.dtype(name)
        # bfloat16: ml_dtypes, imported here, not at import (the Ascend environment lacks it)
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, name))

    @property
    def engram_row_shape(self) -> tuple[int, int, int]:
        """(L_e, C, ed) of a plan token's gathered rows; (L_e, C, 0) with device tables."""
        return (*self.plan_engram_shape, self.engram_row_dim)

    @property
    def spec_tokens(self) -> int:
        """Drafts per request and step at most (0: no speculation)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

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
