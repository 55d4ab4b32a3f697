"""The device mesh of a ParallelConfig and where each parameter lives on it.

Axes ("dp", "ep", "tp") over the first dp x ep x tp devices. Placement:
* routed experts: every leaf of a layer's expert stack split along its expert axis over "ep"
  (model/moe.py computes each rank's own experts inside `shard_map`);
* tensor parallel: the attention's wq_b by output columns (heads), wo_a by output group and
  wo_b by input rows (the same heads' groups), the shared expert's w13 by output and w2 by
  input columns; XLA's SPMD partitioner places the collectives these imply;
* everything else, and the step's state, replicated.
A dimension that the axis size does not divide stays whole (a quantized weight's scale grid
of a tiny model, say): any placement is correct, the partitioner moves what it must.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from deepinfer_jax.config.parallel import MESH_AXES, ParallelConfig

# (path fragment, the split of each of the leaf's leading axes) for tensor parallelism
_TP_SPLITS = ((".attn.wq_b", (None, "tp")), (".attn.wo_a", ("tp",)), (".attn.wo_b", ("tp",)),
              (".shared.w13", (None, "tp")), (".shared.w2", ("tp",)))


def make_mesh(parallel: ParallelConfig) -> Mesh | None:
    """The mesh over the first parallel.size devices; None for one device."""
    if parallel.size == 1:
        return None
    devices = np.asarray(jax.devices()[: parallel.size]).reshape(parallel.mesh_shape)
    return Mesh(devices, MESH_AXES)


def _fitted(spec: tuple, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """spec with every axis the dimension's size does not divide dropped."""
    axes = [axis if axis is not None and dim % mesh.shape[axis] == 0 else None
            for axis, dim in zip(spec, shape, strict=False)]
    return PartitionSpec(*axes)


def param_specs(params, mesh: Mesh):
    """A PartitionSpec per parameter leaf (the module docstring's placement)."""
    def spec(path, leaf):
        name = jax.tree_util.keystr(path)
        if ".moe.experts" in name:
            return _fitted(("ep",), leaf.shape, mesh)
        for fragment, split in _TP_SPLITS:
            if fragment in name:
                return _fitted(split, leaf.shape, mesh)
        return PartitionSpec()
    return jax.tree_util.tree_map_with_path(spec, params)


def place_params(params, mesh: Mesh):
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), param_specs(params, mesh))
    return jax.device_put(params, shardings)


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))


def mesh_context(mesh: Mesh | None):
    """The mesh as tracing's context (jax.set_mesh), or nothing for one device."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()
