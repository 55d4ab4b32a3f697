"""The step's wire format: one host-to-device copy of the plan and one device-to-host copy of
the output per step, instead of one per array.

A BatchPlan is ~23 small arrays and a step output 4-7; each transfer costs host time (for
`jax.device_put`, per array), a large part of a small decode step's host budget
(docs/performance-log.md). A Wire lays a dataclass of arrays out in one int32 buffer
(float32 / uint32 fields bit-cast, bools widened): the plan is packed by numpy on the host
and unpacked inside the jitted step, the output packed inside the step and unpacked on the
host as numpy views.
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
        return sum(math.prod(shape) for _, shape, _ in self.fields)

    def spec(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.size,), jnp.int32)

    # ---- host (numpy) ---------------------------------------------------------------------
    def pack_host(self, value) -> np.ndarray:
        parts = []
        for name, _, dtype in self.fields:
            array = np.ascontiguousarray(getattr(value, name))
            parts.append((array.astype(np.int32) if dtype == "bool" else array.view(np.int32))
                         .reshape(-1))
        return np.concatenate(parts)

    def unpack_host(self, buffer: np.ndarray):
        arrays, offset = {}, 0
        for name, shape, dtype in self.fields:
            n = math.prod(shape)
            part = buffer[offset: offset + n].reshape(shape)
            offset += n
            arrays[name] = part != 0 if dtype == "bool" else part.view(np.dtype(dtype))
        return self.cls(**arrays)

    # ---- device (inside jit) --------------------------------------------------------------
    def pack_device(self, value) -> jax.Array:
        parts = []
        for name, _, dtype in self.fields:
            array = getattr(value, name)
            parts.append((array.astype(jnp.int32) if dtype in ("bool", "int32")
                          else jax.lax.bitcast_convert_type(array, jnp.int32)).reshape(-1))
        return jnp.concatenate(parts)

    def unpack_device(self, buffer: jax.Array):
        arrays, offset = {}, 0
        for name, shape, dtype in self.fields:
            n = math.prod(shape)
            part = jax.lax.slice_in_dim(buffer, offset, offset + n).reshape(shape)
            offset += n
            if dtype == "bool":
                part = part != 0
            elif dtype != "int32":
                part = jax.lax.bitcast_convert_type(part, jnp.dtype(dtype))
            arrays[name] = part
        return self.cls(**arrays)
