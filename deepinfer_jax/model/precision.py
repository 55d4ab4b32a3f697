"""The matmul precision a model's weights ask for.

float32 weights compute their matmuls in float32. A GPU's default precision for float32 dots is
TF32's 10-bit mantissa (~1e-3 relative), where torch's default (`allow_tf32` off) is float32:
the float32 tiny models and the float32 twins that notebooks compare with Hugging Face would
be neither. bfloat16 and quantized weights keep the platform's default.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp


def matmul_precision(dtype) -> contextlib.AbstractContextManager:
    """Enter around a trace: "highest" for float32 weights' dots, the default otherwise."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


def follows_weights(fn):
    """fn(params, ...) traced at its weights' matmul precision (`matmul_precision` of
    params.embed's dtype), whoever calls it: the model's entry points carry it, so that a
    notebook or test jitting them directly gets float32 dots from float32 weights as the
    engine's step does. Read at trace time: the dots keep it whatever lowers them later."""
    @functools.wraps(fn)
    def at_weights_precision(params, *args, **kwargs):
        with matmul_precision(params.embed.dtype):
            return fn(params, *args, **kwargs)
    return at_weights_precision
