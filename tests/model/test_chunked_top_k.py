"""chunked_top_k against lax.top_k (the independent reference): same values and indices,
including ties across chunks, -inf rows and a length that is not a multiple of the chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.device.chunked_top_k import chunked_top_k


@pytest.mark.parametrize("vocab,k,chunk", [(129280, 20, 1024), (5000, 7, 256), (4096, 20, 1024)])
def test_matches_lax_top_k(vocab, k, chunk):
    x = jax.random.normal(jax.random.key(vocab), (5, vocab), jnp.float32)
    x = x.at[1].set(jnp.round(x[1] * 2) / 2)                   # many ties, across chunks
    x = x.at[2].set(-jnp.inf).at[2, 3].set(0.0)               # one finite value, then ties at -inf
    x = x.at[3, vocab - 1].set(100.0)                           # the winner in the padded chunk
    want_values, want_index = jax.lax.top_k(x, k)
    values, index = chunked_top_k(x, k, chunk)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(index), np.asarray(want_index))
