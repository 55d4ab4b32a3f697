"""What the engine adds at start-up to the weights it was given, for its step to read.

The loaded weights are the model's; a few of the step's operands are cheaper made once from
them than at every step. Everything that plans or compiles for the engine's step (the memory
plan's probe, the tests of it, bench/step_ops.py) takes the weights through here.
"""

from __future__ import annotations

import jax.numpy as jnp

from deepinfer_jax.model.mhc import with_mix_parts
from deepinfer_jax.model.params import ModelParams


def with_step_weights(params):
    """The loaded weights plus what the step reads that the engine makes from them once: the
    mHC mixes' bf16 weight parts of a V4 model with bf16 weights (model/mhc.py
    with_mix_parts), instead of a launch a mix every step. The memory plan counts them."""
    if isinstance(params, ModelParams) and params.embed.dtype == jnp.bfloat16:
        return with_mix_parts(params)
    return params
