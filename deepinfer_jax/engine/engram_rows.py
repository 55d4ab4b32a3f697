"""DeepSeek-V4.1's Engram row ids, and rows, for a step's plan where the tables live in host
memory (EngineConfig.engram_tables="host", the default): hashed and gathered on the host.

The hash (model/v41/engram_hash.py) takes each token with the `max_ngram_size - 1` tokens
before it, so a token's ids depend on its sequence's look-back, which may lie in earlier
steps (chunked prefill, decode): each row is hashed with the compressed ids of the tokens
before its span as `history` (DEAD before position 0). The host can only hash tokens it has
seen, so with host tables the engine runs synchronously (config/engine.py host_options): every
token a plan feeds is known when it is built, and a placeholder here is a bug, not a wait.
With the tables on the device the step hashes its own resolved tokens instead
(model/v41/engram_device.py) and the loop may run ahead; `engram_setup` resolves which.

The engine keeps host tables here as numpy arrays in their loaded dtype, never in the device's
parameters, and `fill` also gathers the fed tokens' rows into the plan (`plan.engram_rows`,
one np.take per Engram layer). The rows travel inside the plan's one buffer
(engine/transfer.py): on a GPU an asynchronous jax.device_put issued on the launcher's thread
just before the step is enqueued (engine/compile.py), on the CPU as the executable's own
argument. What overlaps with what: the engine is synchronous here, so the hash, the gather and
the packing run on the host while the device is idle between steps (after the previous step's
tokens were read), and the copy runs ahead of the step on the device's transfer stream; the
step starts when its plan (rows included) has landed. The rows are T x L_e x C x ed values a
step, whatever the tables' size. (Prefetching the next step's rows while a step runs would
need the next step's tokens, which the synchronous loop only has after this step. Over a mesh
the host's rows go with each data-parallel rank's plan.)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.host import HostOptions
from deepinfer_jax.config.step import StepConfig
from deepinfer_jax.config.v41 import EngramConfig
from deepinfer_jax.contract import BatchPlan
from deepinfer_jax.host.decision import ScheduleDecision
from deepinfer_jax.model.v41 import engram_hash


class EngramRows:
    def __init__(self, cfg: EngramConfig, token_map: np.ndarray,
                 tables: tuple[np.ndarray, ...] | None = None):
        """token_map: i64[V] the tokenizer-derived compressed ids (engram_hash). tables: the
        Engram tables in host memory ([N_l, ed] per Engram layer, in layer_ids order), whose
        rows `fill` gathers into the plan; None where they are device weights."""
        self.cfg, self.token_map = cfg, np.asarray(token_map, np.int64)
        self.tables = engram_hash.hash_tables(cfg)
        self.host_tables = tables
        self.back = cfg.max_ngram_size - 1

    def fill(self, plan: BatchPlan, decision: ScheduleDecision) -> None:
        """Write every fed token's row ids into plan.engram_ids i32[T, L_e, C] and, with host
        tables, its rows into plan.engram_rows [T, L_e, C, ed] (in place; padding tokens keep
        zero rows, which the step masks)."""
        self._fill_ids(plan, decision)
        if self.host_tables is not None:
            fed = decision.num_tokens
            for k, table in enumerate(self.host_tables):
                # one vectorised gather per layer, straight into the plan's buffer
                np.take(table, plan.engram_ids[:fed, k], axis=0, out=plan.engram_rows[:fed, k])

    def _fill_ids(self, plan: BatchPlan, decision: ScheduleDecision) -> None:
        """Every fed token hashed at once, each with its own look-back as `history` (a
        one-token call per token: the tokens before it in its row's span, then the row's
        tokens before the span), so the host's cost is a few numpy passes a step, not a few
        per row (about 30 us a row before)."""
        fed, back = decision.num_tokens, self.back
        tokens = np.asarray(plan.token_ids[:fed], np.int64)
        before = np.full((max(len(decision.seqs), 1), back), engram_hash.DEAD, np.int64)
        for row, seq in enumerate(decision.seqs):
            known = seq.request.token_slice(max(seq.start - back, 0), seq.start)
            span = tokens[plan.seq_offset[row]: plan.seq_offset[row] + seq.num_tokens]
            if min(known, default=0) < 0 or (span < 0).any():
                raise RuntimeError(f"request {seq.request.request_id}: a token the host has not "
                                   f"seen reached the Engram hash (asynchronous scheduling "
                                   f"must be off for a model with host Engram tables)")
            if known:
                before[row, back - len(known):] = self.token_map[known]
        row = np.minimum(plan.token_seq[:fed], len(before) - 1)
        place = np.arange(fed) - plan.seq_offset[row]          # within the row's span
        if not place.any():                    # one token a row (decode): the rows' own
            history = before[row]
        else:
            mapped = self.token_map[tokens]
            history = np.empty((fed, back), np.int64)
            for k in range(1, back + 1):       # column back - k: the token k before
                earlier = mapped[np.maximum(np.arange(fed) - k, 0)]
                history[:, back - k] = np.where(
                    place >= k, earlier, before[row, np.clip(back - k + place, 0, back - 1)])
        ids = engram_hash.hash_ids(tokens[:, None], np.ones((fed, 1), bool), self.token_map,
                                   self.cfg, self.tables, history)
        plan.engram_ids[:fed] = ids[:, 0]


def engram_setup(cfg, params, step_cfg: StepConfig, host: HostOptions,
                 token_map: np.ndarray | None):
    """The engine's Engram hashing, resolved once at start-up -> (params, step_cfg,
    EngramRows or None where the host does not hash).
    * Tables on the device (step_cfg.engram_lookback): the step hashes and gathers; the
      params gain the hash's product words (model/v41/engram_device.py), and the loop may run
      asynchronously.
    * Tables in host memory (step_cfg.engram_rows_on_host): the host hashes and gathers, and
      must have read every fed token. The tables leave the parameter pytree, which then holds
      none (`engram_tables == ()`), and the step's rows take their dtype; numpy tables
      (weights/v41.py's host load) are kept as they are, device ones copied back once."""
    if not step_cfg.engram_shape[0]:
        return params, step_cfg, None
    if token_map is None:
        raise EngineConfigError("this model's Engram layers need the token map derived "
                                "from its tokenizer (engram_token_map)")
    if len(params.engram_tables) != len(cfg.engram.layer_ids):
        raise EngineConfigError(f"the parameters hold {len(params.engram_tables)} Engram tables "
                                f"for {len(cfg.engram.layer_ids)} Engram layers")
    if step_cfg.engram_rows_on_host == bool(step_cfg.engram_lookback):
        raise EngineConfigError("Engram ids are hashed by the host with host tables and by the "
                                "step with device tables: one of engram_row_dim and "
                                "engram_lookback must be set")
    if step_cfg.engram_lookback:
        products = engram_hash.product_words(token_map, engram_hash.hash_tables(cfg.engram))
        # over a mesh the rows are split like the experts (model/v41/engram_tables.py): padded
        # to a multiple of those devices (rows past a table's own are never read)
        split = step_cfg.compute.parallel.expert_ranks
        tables = tuple(t if t.shape[0] % split == 0 else
                       jnp.pad(jnp.asarray(t), ((0, -t.shape[0] % split), (0, 0)))
                       for t in params.engram_tables)
        return (params.replace(engram_tables=tables, engram_products=jnp.asarray(products)),
                step_cfg, None)
    if host.async_scheduling:
        raise EngineConfigError("the host hashes every fed token for Engram with host tables: "
                                "asynchronous scheduling must be off for this model")
    tables = tuple(t if isinstance(t, np.ndarray) else np.array(t)
                   for t in params.engram_tables)
    dtypes = {t.dtype for t in tables}
    if len(dtypes) != 1:
        raise EngineConfigError(f"the Engram tables mix dtypes {sorted(map(str, dtypes))}")
    params = params.replace(engram_tables=())
    step_cfg = dataclasses.replace(step_cfg, engram_row_dtype=tables[0].dtype.name)
    return params, step_cfg, EngramRows(cfg.engram, token_map, tables)


def host_table_bytes(rows: EngramRows | None) -> int:
    """Bytes of the Engram tables in host memory (0: none there)."""
    return 0 if rows is None or rows.host_tables is None else sum(
        t.nbytes for t in rows.host_tables)
