"""Copies between the device caches and the KV tiers: one page of compressed rows and one
snapshot of the pool, out or in. A page is every layer's paged arrays: V4's `rows` and
`index_keys`; V4.1's KV sources' `entries` and `index_keys`, each an Fp4Rows (codes and block
scales, copied as stored: the consumer layers own no pages, they read their source's).

Pure functions of fixed shapes, compiled once at start-up (engine/tier_copies.py); the page
and snapshot ids are arrays, so one program serves every copy.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from deepinfer_jax.device.snapshots import SlotRings
from deepinfer_jax.model.state import StateCache
from deepinfer_jax.model.v41.state import V41State


def _paged_field(state: StateCache | V41State) -> str:
    """The name of a layer's compressed rows: every leaf of it and of `index_keys` has
    num_pages * rows_per_page rows, page p's at p * rows_per_page."""
    return "entries" if isinstance(state, V41State) else "rows"


def page_pools(state: StateCache | V41State) -> tuple[jax.Array, ...]:
    """The paged arrays, in a fixed order: per layer, the rows then the index keys (where
    present), each flattened to its leaves (V4.1's codes, then scales)."""
    field = _paged_field(state)
    return tuple(jax.tree.leaves([(getattr(ls, field), ls.index_keys) for ls in state.layers]))


def _rows_per_page(pool: jax.Array, num_pages: int) -> int:
    return pool.shape[0] // num_pages


def gather_page(state: StateCache | V41State, page: jax.Array, num_pages: int) -> tuple[jax.Array, ...]:
    """Each paged array's rows of `page` ([rows_per_page, d] each)."""
    return tuple(jax.lax.dynamic_slice_in_dim(a, page * _rows_per_page(a, num_pages),
                                              _rows_per_page(a, num_pages))
                 for a in page_pools(state))


def scatter_page(state: StateCache | V41State, page: jax.Array, rows: tuple[jax.Array, ...],
                 num_pages: int) -> StateCache | V41State:
    """`state` with `rows` (as gather_page returns them) written into `page`."""
    it, field = iter(rows), _paged_field(state)

    def put(a):
        return jax.lax.dynamic_update_slice_in_dim(a, next(it), page * _rows_per_page(a, num_pages),
                                                   0)

    # tree.map visits the leaves in page_pools' order (None fields have none)
    layers = tuple(dataclasses.replace(ls, **dict(zip((field, "index_keys"), jax.tree.map(
        put, (getattr(ls, field), ls.index_keys)), strict=True))) for ls in state.layers)
    assert next(it, None) is None, "rows of another state's pages"
    return dataclasses.replace(state, layers=layers)


def scatter_pages(state: StateCache | V41State, pages: jax.Array, rows: tuple[jax.Array, ...],
                  num_pages: int) -> StateCache | V41State:
    """`state` with each of `rows` stacked ([B, rows_per_page, d] each, gather_page's arrays
    of B block sets) written into `pages` i32[B]; an id of num_pages writes nothing (a
    batch's padding). Ids must be distinct."""
    it, field = iter(rows), _paged_field(state)

    def put(a):
        paged = a.reshape(num_pages, _rows_per_page(a, num_pages), *a.shape[1:])
        return paged.at[pages].set(next(it), mode="drop").reshape(a.shape)

    layers = tuple(dataclasses.replace(ls, **dict(zip((field, "index_keys"), jax.tree.map(
        put, (getattr(ls, field), ls.index_keys)), strict=True))) for ls in state.layers)
    assert next(it, None) is None, "rows of another state's pages"
    return dataclasses.replace(state, layers=layers)


def gather_snapshot(pool: SlotRings, snapshot: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(p[snapshot] for p in jax.tree.leaves(pool))


def scatter_snapshot(pool: SlotRings, snapshot: jax.Array, rings: tuple[jax.Array, ...]
                     ) -> SlotRings:
    """`pool` with `rings` written into `snapshot` (or, stacked [B, ...], into snapshots
    i32[B]; an id past the pool writes nothing)."""
    leaves, tree = jax.tree.flatten(pool)
    return jax.tree.unflatten(tree, [p.at[snapshot].set(r, mode="drop") for p, r in
                                     zip(leaves, rings, strict=True)])


def compile_tier_copies(state: StateCache | V41State, pool: SlotRings, num_pages: int):
    """(gather_page, scatter_page, gather_snapshot, scatter_snapshot), compiled; the scatters
    donate what they write into."""
    index = jax.ShapeDtypeStruct((), jnp.int32)
    page_rows = jax.eval_shape(lambda s: gather_page(s, 0, num_pages), state)
    rings = jax.eval_shape(lambda p: gather_snapshot(p, 0), pool)
    return (
        jax.jit(gather_page, static_argnums=2).lower(state, index, num_pages).compile(),
        jax.jit(scatter_page, static_argnums=3, donate_argnums=0).lower(
            state, index, page_rows, num_pages).compile(),
        jax.jit(gather_snapshot).lower(pool, index).compile(),
        jax.jit(scatter_snapshot, donate_argnums=0).lower(pool, index, rings).compile())


def compile_batched_loads(state: StateCache | V41State, pool: SlotRings, num_pages: int,
                          batch: int):
    """(scatter_pages, scatter_snapshot) for `batch` block sets at once, compiled: ids
    i32[batch], arrays stacked [batch, ...] (an id past the pool writes nothing); both
    donate what they write into."""
    ids = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def stacked(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct((batch, *x.shape), x.dtype), tree)
    page_rows = stacked(jax.eval_shape(lambda s: gather_page(s, 0, num_pages), state))
    rings = stacked(jax.eval_shape(lambda p: gather_snapshot(p, 0), pool))
    return (jax.jit(scatter_pages, static_argnums=3, donate_argnums=0).lower(
                state, ids, page_rows, num_pages).compile(),
            jax.jit(scatter_snapshot, donate_argnums=0).lower(pool, ids, rings).compile())
