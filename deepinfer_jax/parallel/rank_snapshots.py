"""The prefix cache's slot snapshots with data-parallel ranks: a snapshot pool per rank and
the save / restore copies run per rank.

Each rank's prefix cache (its Scheduler's, host/ranks.py) numbers its own snapshots and
slots, so the pool is stacked on a leading rank axis split over "dp", as the state is
(parallel/mesh.py `init_rank_states`), and each copy's ids come a rank's row each: [dp, w].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from deepinfer_jax.device import snapshots
from deepinfer_jax.device.snapshots import SlotRings
from deepinfer_jax.model.state import StateCache

RANK = PartitionSpec("dp")


def per_rank(fn, arguments: int):
    """fn applied to each rank's slice of `arguments` arguments stacked on a leading rank
    axis ([dp, ...], split over "dp"); its result stacked the same way."""
    def body(*args):
        out = fn(*jax.tree.map(lambda x: x[0], args))
        return jax.tree.map(lambda x: x[None], out)
    return jax.shard_map(body, in_specs=(RANK,) * arguments, out_specs=RANK, axis_names={"dp"},
                         check_vma=False)


def init_rank_pool(state: StateCache, count: int, *, spare: int) -> SlotRings:
    """A pool of `count` snapshots per rank, for rank-stacked `state`."""
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    return jax.jit(per_rank(lambda s: snapshots.init_pool(s, count, spare=spare), 1),
                   out_shardings=NamedSharding(mesh, RANK))(state)


def compile_rank_copies(state: StateCache, pool: SlotRings, width: int, max_len: int):
    """(save, restore) as device/snapshots.py compile_copies, per rank: every id argument
    [dp, width] (and tokens [dp, width, max_len]), a rank's row each."""
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    ranks = jax.tree.leaves(state)[0].shape[0]

    def spec(*shape):
        return jax.ShapeDtypeStruct((ranks, *shape), jnp.int32,
                                    sharding=NamedSharding(mesh, RANK))
    ids, tokens = spec(width), spec(width, max_len)
    save = jax.jit(per_rank(snapshots.save, 5), donate_argnums=(1,)).lower(
        snapshots.slot_rings(state), pool, ids, ids, ids).compile()
    restore = jax.jit(per_rank(snapshots.restore, 7), donate_argnums=(0,)).lower(
        state, pool, ids, ids, tokens, ids, ids).compile()
    return save, restore
