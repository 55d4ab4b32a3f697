"""chunked_top_k against lax.top_k (the independent reference): same values and indices,
including ties across chunks, -inf rows and a length that is not a multiple of the chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deepinfer_jax.device.chunked_top_k import chunked_top_k


@pytest.mark.parametrize("vocab,k,chunk", [(129280, 20, 128), (129280, 20, 1024), (5000, 7, 256),
                                           (4096, 20, 1024), (3000, 9, 64)])
def test_matches_lax_top_k(vocab, k, chunk):
    x = jax.random.normal(jax.random.key(vocab), (5, vocab), jnp.float32)
    x = x.at[1].set(jnp.round(x[1] * 2) / 2)                   # many ties, across chunks
    x = x.at[2].set(-jnp.inf).at[2, 3].set(0.0)               # one finite value, then ties at -inf
    x = x.at[3, vocab - 1].set(100.0)                           # the winner in the padded chunk
    want_values, want_index = jax.lax.top_k(x, k)
    values, index = chunked_top_k(x, k, chunk)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(index), np.asarray(want_index))


@pytest.mark.parametrize("chunk", [64, 128])
def test_ties_and_crowded_chunks(chunk):
    """The cases the chunk preselection could get wrong: every value equal (the first k
    indices win), the whole top k inside one chunk, more chunks sharing the k-th chunk
    maximum than are chosen, and the best values at chunk edges."""
    vocab, k = 4000, 20
    rng = np.random.default_rng(0)
    x = np.asarray(rng.standard_normal((6, vocab)), np.float32)
    x[0] = 1.5                                                   # all tied
    x[1, 700: 700 + k] = 50.0 + np.arange(k)                     # the top k in one chunk
    x[2, ::chunk] = 9.0                                          # every chunk has one maximum
    x[2, 5 * chunk + 1] = 9.0                                    # and one chunk holds two of it
    x[3, chunk - 1::chunk] = 7.0                                 # maxima on the last slot
    x[3, chunk::chunk] = 7.0                                     # and the next chunk's first
    x[4] = np.round(x[4])                                        # coarse ties everywhere
    x[5, 3] = np.inf                                             # one infinite winner
    want_values, want_index = jax.lax.top_k(jnp.asarray(x), k)
    values, index = chunked_top_k(jnp.asarray(x), k, chunk)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(index), np.asarray(want_index))
