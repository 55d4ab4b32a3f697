"""A large tensor placed on the device a piece at a time, written in place.

The loader reads the routed-expert stacks (2 GiB of FP4 codes per V4-Flash layer) and the
embedding and LM head (1 GiB each) in host pieces of STACK_CHUNK_BYTES. `Pieces` allocates the
whole array once on the device (zeros, made there) and writes each piece into it with a
donated `dynamic_update_slice`, so that:

* the device never holds the pieces and their concatenation at once (a join would need the
  whole tensor twice);
* at most IN_FLIGHT pieces are in transfer: `jax.device_put` returns before its copy ends and
  the host buffer (and, on a GPU, the pinned staging buffer it is copied through, a pool that
  grows to the bytes in flight and is kept) lives until then, so a loader that does not wait
  runs ahead by as many pieces as it can read.
"""

from __future__ import annotations

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

IN_FLIGHT = 1       # pieces in transfer while the next is read: reading overlaps copying


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("axis",))
def _write(whole: jax.Array, piece: jax.Array, start, axis: int) -> jax.Array:
    """whole with `piece` at `start` on `axis`, the rest of the index 0; whole's buffer is
    reused."""
    index = [0] * whole.ndim
    index[axis] = start
    return lax.dynamic_update_slice(whole, piece.astype(whole.dtype), tuple(index))


# Its own program, not fused into _write: XLA's CPU backend writes a transposed update
# several times slower than it transposes and then writes (1.4 s vs 0.25 s for 256 MiB).
_transposed = jax.jit(lambda piece: piece.T)


class Pieces:
    """A device pytree of the shapes and dtypes in `like` (leaves with .shape and .dtype),
    filled by `write(host_pytree, start)`; `result()` is the filled pytree."""

    def __init__(self, like, axis: int = 0, transpose: bool = False):
        self.whole = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), like)
        self.axis, self.transpose = axis, transpose
        self._pending: collections.deque = collections.deque()

    def write(self, host, start: int) -> None:
        """Copy the host pieces to the device and into place at `start` along the axis;
        waits for the copy issued IN_FLIGHT pieces ago first."""
        piece = jax.device_put(host)
        written = jax.tree.map(_transposed, piece) if self.transpose else piece
        self.whole = jax.tree.map(functools.partial(_write, start=start, axis=self.axis),
                                  self.whole, written)
        self._pending.append(piece)
        while len(self._pending) > IN_FLIGHT:
            jax.block_until_ready(self._pending.popleft())

    def result(self):
        self._pending.clear()
        return self.whole


def place_rows(read_rows, shape: tuple[int, int], stored_dtype, dtype, transpose: bool, check,
               piece_bytes: int):
    """A [rows, cols] tensor on the device ([cols, rows] if transpose) as `dtype`, read
    piece_bytes of rows at a time: read_rows(first, host buffer of stored_dtype) fills rows
    first, ...; check(host piece) sees each piece as read."""
    rows = max(1, piece_bytes // (shape[1] * max(np.dtype(stored_dtype).itemsize,
                                                 np.dtype(dtype).itemsize)))
    whole = Pieces(jax.ShapeDtypeStruct(shape[::-1] if transpose else shape, dtype),
                   axis=int(transpose), transpose=transpose)
    for first in range(0, shape[0], rows):
        piece = np.empty((min(rows, shape[0] - first), shape[1]), stored_dtype)
        read_rows(first, piece)
        check(piece)
        whole.write(piece.astype(dtype, copy=False), first)
        del piece
    return whole.result()
