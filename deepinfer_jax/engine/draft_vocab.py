"""The MTP block's draft vocabulary (speculative_config.draft_token_map), resolved once at
start-up.

A draft costs the MTP layer and a read of the whole LM head (129280 x 4096 in V4-Flash,
about 1 GB in bf16), a large share of a small batch's step. With a token map the block scores
only the mapped tokens, through their columns of the head copied out once here
(`MTPParams.draft_head`), and proposes the best of them. Verification is unchanged, so
outputs are exactly those of decoding without drafts; a token outside the map is only never
drafted, which costs acceptance where the model would have drafted it.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.step import StepConfig


def read_token_map(path: str, vocab_size: int) -> np.ndarray:
    """The token ids of a map file (a JSON list, or a .npy array of integers) -> i32[V'],
    checked: at least one id, each in [0, vocab_size), none twice."""
    file = Path(path)
    what = f"speculative_config.draft_token_map {path!r}"
    try:
        ids = np.load(file) if file.suffix == ".npy" else np.asarray(json.loads(file.read_text()))
    except (OSError, ValueError) as why:
        raise EngineConfigError(f"{what}: cannot be read ({why})") from None
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise EngineConfigError(f"{what}: expected a non-empty list of integer token ids, "
                                f"found {ids.dtype} of shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise EngineConfigError(f"{what}: ids must be in [0, {vocab_size}), found "
                                f"{ids.min()}..{ids.max()}")
    unique, counts = np.unique(ids, return_counts=True)
    if (counts > 1).any():
        raise EngineConfigError(f"{what}: token {unique[counts > 1][0]} is listed "
                                f"{counts.max()} times")
    return ids.astype(np.int32)


def draft_vocab_setup(params, step_cfg: StepConfig, vocab_size: int):
    """params with the MTP block's draft ids and head columns where the step's speculative
    config names a token map; params as they are otherwise."""
    spec = step_cfg.speculative
    if spec is None or spec.draft_token_map is None:
        return params
    ids = read_token_map(spec.draft_token_map, vocab_size)
    if not isinstance(params.head, (jax.Array, np.ndarray)):
        raise EngineConfigError("speculative_config.draft_token_map needs an LM head stored "
                                f"unquantized, found {type(params.head).__name__}")
    draft_head = jnp.take(jnp.asarray(params.head), jnp.asarray(ids), axis=1)    # [D, V']
    mtp = tuple(block.replace(draft_ids=jnp.asarray(ids), draft_head=draft_head)
                for block in params.mtp)
    return params.replace(mtp=mtp)
