"""The plan's wire format: one host-to-device copy per step instead of one per array.

A BatchPlan is ~23 small arrays; `jax.device_put` costs host time per array (about 0.1 ms each
on a 2-core CPU), a large part of a small decode step's host budget. A PlanWire packs them
into one int32 buffer on the host (float32 / uint32 fields bit-cast, bools widened) and
unpacks it inside the jitted step, where the slices and bit-casts cost nothing.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.plan import BatchPlan


@dataclasses.dataclass(frozen=True)
class PlanWire:
    fields: tuple[tuple[str, tuple[int, ...], str], ...]   # (name, shape, dtype name) in order

    @classmethod
    def for_plan(cls, plan: BatchPlan) -> PlanWire:
        """The layout of a bucket's plans (any plan of that bucket: the shapes are fixed)."""
        return cls(tuple((f.name, tuple(getattr(plan, f.name).shape),
                          np.dtype(getattr(plan, f.name).dtype).name)
                         for f in dataclasses.fields(plan)))

    @property
    def size(self) -> int:
        return sum(math.prod(shape) for _, shape, _ in self.fields)

    def spec(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((self.size,), jnp.int32)

    def pack(self, plan: BatchPlan) -> np.ndarray:
        """Host: the plan's arrays -> i32[size]."""
        parts = []
        for name, _, dtype in self.fields:
            array = np.ascontiguousarray(getattr(plan, name))
            parts.append((array.astype(np.int32) if dtype == "bool" else array.view(np.int32))
                         .reshape(-1))
        return np.concatenate(parts)

    def unpack(self, buffer: jax.Array) -> BatchPlan:
        """Device (inside jit): i32[size] -> the plan's arrays."""
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
        return BatchPlan(**arrays)
