"""One decorator for every bundle of arrays: a frozen dataclass registered as a pytree.

Fields whose metadata says `static=True` become pytree metadata (hashed, part of the jit
signature); every other field is a child. Keep static fields rare: a value that varies per
step belongs in an array so that one compiled program serves all traffic.
"""

from __future__ import annotations

import dataclasses

import jax


def static_field(**kwargs):
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls):
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    meta = [f.name for f in fields if f.metadata.get("static")]
    data = [f.name for f in fields if not f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)
