"""DeepSeek-V4.1's Engram row ids for a step's plan, hashed on the host (no jax).

The hash (model/v41/engram_hash.py) takes each token with the `max_ngram_size - 1` tokens
before it, so a token's ids depend on its sequence's look-back, which may lie in earlier
steps (chunked prefill, decode): each row is hashed with the compressed ids of the tokens
before its span as `history` (DEAD before position 0). The host can only hash tokens it has
seen, so with Engram the engine runs synchronously (config/engine.py host_options): every
token a plan feeds is known when it is built, and a placeholder here is a bug, not a wait.
"""

from __future__ import annotations

import numpy as np

from deepinfer_jax.config.v41 import EngramConfig
from deepinfer_jax.contract import BatchPlan
from deepinfer_jax.host.decision import ScheduleDecision
from deepinfer_jax.model.v41 import engram_hash


class EngramRows:
    def __init__(self, cfg: EngramConfig, token_map: np.ndarray):
        """token_map: i64[V] the tokenizer-derived compressed ids (engram_hash)."""
        self.cfg, self.token_map = cfg, np.asarray(token_map, np.int64)
        self.tables = engram_hash.hash_tables(cfg)
        self.back = cfg.max_ngram_size - 1

    def fill(self, plan: BatchPlan, decision: ScheduleDecision) -> None:
        """Write every fed token's row ids into plan.engram_ids i32[T, L_e, C] (in place)."""
        for row, seq in enumerate(decision.seqs):
            start, n = seq.start, seq.num_tokens
            offset = int(plan.seq_offset[row])
            tokens = np.asarray(plan.token_ids[offset: offset + n], np.int64)
            before = np.asarray(seq.request.token_slice(max(start - self.back, 0), start),
                                np.int64)
            if (tokens < 0).any() or (before < 0).any():
                raise RuntimeError(f"request {seq.request.request_id}: a token the host has not "
                                   f"seen reached the Engram hash (asynchronous scheduling "
                                   f"must be off for a model with Engram)")
            history = np.full((1, self.back), engram_hash.DEAD, np.int64)
            if len(before):
                history[0, self.back - len(before):] = self.token_map[before]
            ids = engram_hash.hash_ids(tokens[None], np.ones((1, n), bool), self.token_map,
                                       self.cfg, self.tables, history)
            plan.engram_ids[offset: offset + n] = ids[0]
