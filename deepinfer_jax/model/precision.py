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


def rounded_to(x: jax.Array, dtype) -> jax.Array:
    """float32 x rounded to dtype's precision, kept in float32: `x.astype(dtype).astype(float32)`
    as the CPU computes it. Not written as that pair: XLA's GPU compiler drops chains of float
    conversions (`simplify-fp-conversions`, on under its default `xla_allow_excess_precision`),
    so there the pair is x. `reduce_precision` is the rounding as an op of its own, equal to the
    cast for formats with float32's exponent range (bfloat16); V4.1's float8 rounding is
    model/v41/fake_quant.round_e4m3."""
    info = jnp.finfo(dtype)
    if jnp.dtype(dtype) == jnp.float32:
        return x
    if info.nexp != 8:
        raise ValueError(f"rounded_to takes float32's exponent range, not {jnp.dtype(dtype)}")
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
