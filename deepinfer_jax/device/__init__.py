"""The device side: the jitted step and what it is made of, as pure functions of arrays.

Importing any device module registers the host/device contract's dataclasses as pytrees, so
that a BatchPlan can enter a jitted function and a StepOutput leave one.
"""

import dataclasses

import jax

from deepinfer_jax.contract import CROSSING_TYPES

for _cls in CROSSING_TYPES:
    jax.tree_util.register_dataclass(
        _cls, data_fields=[f.name for f in dataclasses.fields(_cls)], meta_fields=[])
