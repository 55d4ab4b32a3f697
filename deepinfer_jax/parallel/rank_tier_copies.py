"""The KV tiers' copies with data-parallel ranks: one page or snapshot of one rank's state out,
or in, while the state and the snapshot pool are stacked on a leading rank axis split over
"dp" (parallel/mesh.py `init_rank_states`, rank_snapshots.py).

Every rank runs the copy on its own slice (rank_snapshots.per_rank), with its own id: a
gather's result is stacked [dp, ...] and the caller keeps the asking rank's row; in a scatter
only the `active` rank writes the rows given, the others write back the rows their page (or
snapshot) already holds, so no rank copies its whole pool. The device/tier_copies.py
functions do the work, so a page means the same rows as on one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from deepinfer_jax.device import tier_copies as tiers
from deepinfer_jax.device.snapshots import SlotRings
from deepinfer_jax.parallel.rank_snapshots import RANK, per_rank


def _scatter_page(state, page, active, rows, num_pages):
    held = tiers.gather_page(state, page, num_pages)
    rows = tuple(jnp.where(active > 0, r, h) for r, h in zip(rows, held, strict=True))
    return tiers.scatter_page(state, page, rows, num_pages)


def _scatter_snapshot(pool: SlotRings, snapshot, active, rings):
    held = tiers.gather_snapshot(pool, snapshot)
    rings = tuple(jnp.where(active > 0, r, h) for r, h in zip(rings, held, strict=True))
    return tiers.scatter_snapshot(pool, snapshot, rings)


def compile_rank_tier_copies(state, pool: SlotRings, num_pages: int):
    """(gather_page, scatter_page, gather_snapshot, scatter_snapshot), compiled for rank-stacked
    `state` and `pool`: ids i32[dp] (a rank's each), the scatters' `active` i32[dp] (1: this
    rank writes) and rows stacked [dp, ...]; the scatters donate what they write into."""
    mesh = jax.tree.leaves(state)[0].sharding.mesh
    ranks = jax.tree.leaves(state)[0].shape[0]
    sharded = NamedSharding(mesh, RANK)
    ids = jax.ShapeDtypeStruct((ranks,), jnp.int32, sharding=sharded)

    def stacked(shapes):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharded),
                            shapes)

    def gather_page(s, page):
        return tiers.gather_page(s, page, num_pages)

    def scatter_page(s, page, active, rows):
        return _scatter_page(s, page, active, rows, num_pages)

    page_rows = stacked(jax.eval_shape(per_rank(gather_page, 2), state, ids))
    rings = stacked(jax.eval_shape(per_rank(tiers.gather_snapshot, 2), pool, ids))
    return (jax.jit(per_rank(gather_page, 2)).lower(state, ids).compile(),
            jax.jit(per_rank(scatter_page, 4), donate_argnums=0).lower(
                state, ids, ids, page_rows).compile(),
            jax.jit(per_rank(tiers.gather_snapshot, 2)).lower(pool, ids).compile(),
            jax.jit(per_rank(_scatter_snapshot, 4), donate_argnums=0).lower(
                pool, ids, ids, rings).compile())
