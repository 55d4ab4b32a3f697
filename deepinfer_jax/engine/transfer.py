"""The step's wire format: one host-to-device copy of the plan and one device-to-host copy of
the output per step, instead of one per array.

A BatchPlan is ~23 small arrays and a step output 4-7; each transfer costs host time (for
`jax.device_put`, per array), a large part of a small decode step's host budget
(docs/performance-log.md). A Wire lays a dataclass of arrays out in one int32 buffer
(float32 / uint32 fields bit-cast, bools widened, 2-byte fields such as the Engram rows in
bfloat16 two to a word): the plan is packed by numpy on the host and unpacked inside the
jitted step, the output packed inside the step and unpacked on the host as numpy views.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Wire:
    cls: type                                               # the dataclass the buffer carries
    fields: tuple[tuple[str, tuple[int, ...], str], ...]    # (name, shape, dtype name) in order

    @classmethod
    def of(cls, value) -> Wire:
        """The layout of `value` (a dataclass of arrays or ShapeDtypeStructs)."""
        return cls(type(value), tuple((f.name, tuple(getattr(value, f.name).shape),
                                       np.dtype(getattr(value, f.name).dtype).name)
                                      for f in dataclasses.fields(value)))

    @property
    def size(self) -> int:
        return sum(_words(shape, dtype) for _, shape, dtype in self.fields)

    def spec(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.size,), jnp.int32)

    # ---- host (numpy) ---------------------------------------------------------------------
    def pack_host(self, value) -> np.ndarray:
        parts = []
        for name, _, dtype in self.fields:
            array = np.ascontiguousarray(getattr(value, name))
            parts.append(array.astype(np.int32).reshape(-1) if dtype == "bool" else
                         array.reshape(-1).view(np.int32))
        return np.concatenate(parts)

    def unpack_host(self, buffer: np.ndarray):
        arrays, offset = {}, 0
        for name, shape, dtype in self.fields:
            n = _words(shape, dtype)
            part = buffer[offset: offset + n]
            offset += n
            arrays[name] = (part.reshape(shape) != 0 if dtype == "bool"
                            else part.view(jnp.dtype(dtype)).reshape(shape))
        return self.cls(**arrays)

    # ---- device (inside jit) --------------------------------------------------------------
    def pack_device(self, value) -> jax.Array:
        parts = []
        for name, _, dtype in self.fields:
            array = getattr(value, name)
            if dtype in ("bool", "int32"):
                parts.append(array.astype(jnp.int32).reshape(-1))
            else:      # 4-byte: one word an element; 2-byte: two elements a word
                per_word = 4 // jnp.dtype(dtype).itemsize
                parts.append(jax.lax.bitcast_convert_type(
                    array.reshape(-1) if per_word == 1 else array.reshape(-1, per_word),
                    jnp.int32))
        return jnp.concatenate(parts)

    def unpack_device(self, buffer: jax.Array):
        arrays, offset = {}, 0
        for name, shape, dtype in self.fields:
            n = _words(shape, dtype)
            part = jax.lax.slice_in_dim(buffer, offset, offset + n)
            offset += n
            if dtype == "bool":
                part = part != 0
            elif dtype != "int32":     # a 2-byte dtype comes out as [n, 2]
                part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
            arrays[name] = part.reshape(shape)
        return self.cls(**arrays)


def start_host_copy(*arrays: jax.Array) -> None:
    """Start the arrays' device-to-host copies (the step's output, spilled KV pages) as the
    intended transfers they are, allowed by name as the plan's copy is (compile.py), so that a
    "disallow" guard around the loop still catches any other. jax counts a bare
    `copy_to_host_async` as implicit: refused on a GPU, a no-op on the CPU."""
    with jax.transfer_guard_device_to_host("allow"):
        for array in arrays:
            array.copy_to_host_async()


def _words(shape: tuple[int, ...], dtype: str) -> int:
    """int32 words a field takes: one an element (bools widened), or its bytes / 4 for a
    2-byte dtype, whose element count must then be even (the Engram rows' head_dim is)."""
    n = math.prod(shape)
    if dtype == "bool" or jnp.dtype(dtype).itemsize == 4:
        return n
    if jnp.dtype(dtype).itemsize != 2 or n % 2:
        raise ValueError(f"the wire carries 4-byte fields and even-sized 2-byte ones, not "
                         f"{dtype}{list(shape)}")
    return n // 2
