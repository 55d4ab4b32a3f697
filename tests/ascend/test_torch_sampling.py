"""The torch sampler (ascend_backend/sampling.py) against the JAX step's (device/sampling.py)
on the same rows: penalties and the grammar bitmask (what greedy rows take the argmax of),
and the temperature / top-k / top-p / min-p filter (which tokens a sampled row may draw).
Seeded draws are the torch generator's, not JAX's threefry stream: they are checked to lie in
the filtered set and to repeat for the same (seed, position)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.device.sampling import SamplingRows, filter_logits, process_logits
from tests.ascend.ascend_env import needs_ascend_env, run_in_ascend_env

pytestmark = needs_ascend_env

TORCH_SIDE = """
import sys, numpy as np, torch
from types import SimpleNamespace
from ascend_backend.sampling import draw, filter_logits, process_logits
d = dict(np.load(sys.argv[1]))
t = {k: torch.as_tensor(v.astype(np.int64) if v.dtype.kind in 'iu' else v) for k, v in d.items()}
rows = SimpleNamespace(**{k: t[k] for k in ('temperature', 'top_k', 'top_p', 'min_p',
    'repetition_penalty', 'presence_penalty', 'frequency_penalty', 'seed', 'position',
    'allowed')})
processed = process_logits(t['logits'], rows, t['prompt_mask'].bool(), t['output_counts'])
filtered = filter_logits(processed, rows)
np.savez(sys.argv[2], processed=processed.numpy(), filtered=filtered.numpy(),
         drawn=draw(filtered, rows.seed, rows.position).numpy(),
         again=draw(filtered, rows.seed, rows.position).numpy())
"""


@pytest.fixture(scope="module")
def rows():
    rng = np.random.default_rng(3)
    n, vocab = 8, 512
    f32 = lambda *v: np.array(v, np.float32)  # noqa: E731
    allowed = rng.integers(-2**31, 2**31, size=(n, vocab // 32), dtype=np.int64).astype(np.int32)
    allowed[:4] = -1                                       # rows 0-3: every token allowed
    return dict(
        logits=(rng.standard_normal((n, vocab)) * 3).astype(np.float32),
        temperature=f32(0, 0.7, 1.0, 1.3, 0.9, 1.0, 0.5, 2.0),
        top_k=np.array([0, 5, 0, 40, 0, 1, 0, 100], np.int32),
        top_p=f32(1, 1, 0.8, 0.9, 1, 1, 0.3, 1),
        min_p=f32(0, 0, 0, 0.05, 0.2, 0, 0, 0),
        repetition_penalty=f32(1, 1.2, 1, 1, 1.5, 1, 1, 1),
        presence_penalty=f32(0, 0, 0.5, 0, 0, 0, 0, 1),
        frequency_penalty=f32(0, 0, 0, 0.3, 0, 0, 0.2, 0),
        seed=rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32),
        position=rng.integers(0, 4000, size=n).astype(np.int32),
        allowed=allowed,
        prompt_mask=rng.random((n, vocab)) < 0.1,
        output_counts=rng.integers(0, 3, size=(n, vocab)).astype(np.int32) * (rng.random((n, vocab)) < 0.05))


def test_processed_and_filtered_logits_match_the_jax_sampler(rows, tmp_path):
    np.savez(tmp_path / "rows.npz", **rows)
    run_in_ascend_env("-c", TORCH_SIDE, str(tmp_path / "rows.npz"), str(tmp_path / "out.npz"))
    ours = dict(np.load(tmp_path / "out.npz"))
    fields = {k: jnp.asarray(v) for k, v in rows.items()
              if k not in ("logits", "prompt_mask", "output_counts")}
    jax_rows = SamplingRows(**fields)
    processed = np.asarray(process_logits(jnp.asarray(rows["logits"]), jax_rows,
                                          jnp.asarray(rows["prompt_mask"]),
                                          jnp.asarray(rows["output_counts"])))
    filtered = np.asarray(filter_logits(jnp.asarray(processed), jax_rows))
    assert np.isinf(processed[4:]).any()                  # the bitmask rows mask something
    np.testing.assert_array_equal(np.isinf(ours["processed"]), np.isinf(processed))
    np.testing.assert_allclose(ours["processed"], processed, rtol=1e-6)
    hot = rows["temperature"] > 0
    np.testing.assert_array_equal(np.isinf(ours["filtered"][hot]), np.isinf(filtered[hot]))
    np.testing.assert_allclose(ours["filtered"][hot], filtered[hot], rtol=1e-6)
    kept = ~np.isinf(filtered)
    assert kept[5].sum() == 1 and kept[1].sum() <= 5       # top-k 1 and 5 are in force
    drawn = ours["drawn"]
    assert kept[np.arange(len(drawn)), drawn][hot].all()
    np.testing.assert_array_equal(drawn, ours["again"])
