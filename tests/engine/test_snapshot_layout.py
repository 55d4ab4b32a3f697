"""The compact snapshot layout (device/snapshot_layout.py) against the rule written out here in
numpy: a save at block end E and a restore into another slot bring back the window rings
whole and, of each overlapping compressor's tail, the first halves of positions E-m .. E-1 at
their ring rows; the rest of that tail is zero, the HCA tails and the other slots untouched.
That these are all a later token reads is what the engine's warm-equals-cold tests check
(tests/engine/test_prefix_cache.py, test_kv_tiers_engine.py, test_prefix_replay.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.config.engine import EngineConfig
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.memory import slot_ring_bytes, snapshot_bytes
from deepinfer_jax.device import snapshots
from deepinfer_jax.model.state import init_state
from tests.conftest import REPO

CFG = read_model_config(REPO / "configs/tiny/tiny-mixed.json")
SRC, DST = 1, 2


def _random_state(step_cfg, seed):
    state = init_state(CFG, step_cfg, jnp.bfloat16)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [
        jax.random.normal(k, x.shape).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else x for k, x in zip(keys, leaves)])


def _step_cfg(spec: int, bounded: bool = False):
    options = dict(enable_prefix_caching=True, max_num_seqs=4, max_model_len=256, page_size=64)
    if spec:
        options["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec}
    if bounded:
        options["prefix_replay"] = "bounded"
    return EngineConfig(**options).resolve(CFG)


def _copy(src_state, dst_state, step_cfg, end, windows=True):
    pool = snapshots.init_pool(src_state, step_cfg.num_snapshots, windows,
                               spare=step_cfg.spec_tokens)
    ids = lambda *v: jnp.array(v, jnp.int32)            # noqa: E731
    # two copies per call: the real one, and padding (an out-of-range snapshot / slot)
    pool = snapshots.save(snapshots.slot_rings(src_state, windows), pool, ids(SRC, 0),
                          ids(3, step_cfg.num_snapshots), ids(end, 0))
    tokens = jnp.full((2, 8), -1, jnp.int32)
    restored = snapshots.restore(dst_state, pool, ids(3, 0), ids(DST, step_cfg.max_num_seqs),
                                 tokens, ids(0, 0), ids(end, 0))
    return pool, restored


@pytest.mark.parametrize("spec, end", [(0, 64), (0, 128), (3, 64), (3, 192)])
def test_a_restored_slot_holds_the_windows_and_the_closed_blocks_first_halves(spec, end):
    step_cfg = _step_cfg(spec)
    src, dst = _random_state(step_cfg, 0), _random_state(step_cfg, 1)
    pool, out = _copy(src, dst, step_cfg, end)
    m = CFG.compress_rate_csa
    for s, d, o in zip(src.layers, dst.layers, out.layers, strict=True):
        np.testing.assert_array_equal(o.window[DST], s.window[SRC])
        for name in ("tail", "index_tail"):
            st, dt, ot = getattr(s, name), getattr(d, name), getattr(o, name)
            if st is None:
                continue
            if s.index_tail is None:            # HCA: nothing kept, nothing restored
                np.testing.assert_array_equal(ot.kv, dt.kv)
                np.testing.assert_array_equal(ot.score, dt.score)
                continue
            for field in ("kv", "score"):
                src_ring, got = np.asarray(getattr(st, field)), np.asarray(getattr(ot, field))
                ring, half = src_ring.shape[1], src_ring.shape[2] // 2
                expected = np.zeros_like(src_ring[SRC])
                for p in range(end - m, end):
                    expected[p % ring, :half] = src_ring[SRC, p % ring, :half]
                np.testing.assert_array_equal(got[DST], expected)
                others = [i for i in range(src_ring.shape[0]) if i != DST]
                np.testing.assert_array_equal(got[others], np.asarray(getattr(dt, field))[others])
        for other in (0, 3):
            np.testing.assert_array_equal(o.window[other], d.window[other])
    if spec:
        np.testing.assert_array_equal(out.mtp.window[DST], src.mtp.window[SRC])
    # the pool holds what the memory plan counts, less than the slot's rings
    pool_bytes = sum(x.nbytes for x in jax.tree.leaves(pool))
    assert pool_bytes == step_cfg.num_snapshots * snapshot_bytes(CFG, spec, 2)
    assert snapshot_bytes(CFG, spec, 2) < slot_ring_bytes(CFG, spec, 2)


def test_without_windows_only_the_closed_halves_are_kept_and_restored():
    step_cfg = _step_cfg(0, bounded=True)
    src, dst = _random_state(step_cfg, 2), _random_state(step_cfg, 3)
    pool, out = _copy(src, dst, step_cfg, 128, windows=False)
    assert all(w is None for w, _, _ in pool[0])
    for s, d, o in zip(src.layers, dst.layers, out.layers, strict=True):
        np.testing.assert_array_equal(o.window, d.window)
        if s.index_tail is not None:
            ring = s.index_tail.kv.shape[1]
            rows = [p % ring for p in range(124, 128)]
            half = s.index_tail.kv.shape[2] // 2
            np.testing.assert_array_equal(o.index_tail.kv[DST][rows, :half],
                                          s.index_tail.kv[SRC][rows, :half])
    assert sum(x.nbytes for x in jax.tree.leaves(pool)) == step_cfg.num_snapshots * (
        snapshot_bytes(CFG, 0, 2, windows=False))
