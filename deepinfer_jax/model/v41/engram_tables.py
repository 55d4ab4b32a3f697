"""Where a step reads DeepSeek-V4.1's Engram rows from device tables (engram_tables="device"):
whole on one device, or split by rows over a mesh.

The released tables (about 384M rows of 256 each, two layers) do not fit one device beside the
weights, so over a mesh each table's rows are split like the routed experts, over the "dp",
"cp" and "ep" axes together (parallel/mesh.py; the engine pads the rows to a multiple of those
devices, engine/engram_rows.py), and replicated over "tp". A lookup then works as the experts
do (model/moe.py expert_parallel): every device takes the ids of all tokens its rows may
serve (all-gathered over "dp", whose ranks plan their own tokens), reads the rows it holds
and zeros for the rest, and a sum over the axes brings each row from its one holder, exact
in any precision because every other term is zero; over "dp" the sum is scattered back to
each rank's own tokens. So a token reads the same bits as from a whole table.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from deepinfer_jax.config.compute import ComputeConfig
from deepinfer_jax.model.moe import exact_sum, expert_device

Array = jax.Array


def table_rows(table: Array, ids: Array, compute: ComputeConfig) -> Array:
    """table [N, ed] (this rank's share of the rows with data-parallel ranks), ids i32[T, C]
    -> rows [T, C, ed] in the table's dtype."""
    parallel = compute.parallel
    if parallel.expert_ranks == 1:
        return table[ids]
    # "dp" is manual here already (the step's per-rank map, parallel/mesh.py over_ranks);
    # the step's tokens are whole on every "cp" device at this point (the layers split them)
    mapped = tuple(axis for axis, size in (("cp", parallel.cp), ("ep", parallel.ep)) if size > 1)

    def local(ids, table):
        if parallel.dp > 1:
            ids = jax.lax.all_gather(ids, "dp", tiled=True)
        count = table.shape[0]
        first = expert_device(parallel) * count
        mine = (ids >= first) & (ids < first + count)
        rows = jnp.where(mine[..., None], table[jnp.clip(ids - first, 0, count - 1)], 0)
        for axis in mapped:
            rows = exact_sum(jax.lax.psum, rows, axis, compute)
        if parallel.dp > 1:
            rows = exact_sum(functools.partial(jax.lax.psum_scatter, tiled=True), rows, "dp",
                             compute)
        return rows

    if mapped:
        local = jax.shard_map(local, in_specs=(PartitionSpec(), PartitionSpec(mapped)),
                              out_specs=PartitionSpec(), axis_names=set(mapped), check_vma=False)
    return local(ids, table)
