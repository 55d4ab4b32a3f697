"""Ways to write a step's rows into the state cache's rings, timed apart from the step.

    python bench/ring_writes.py            # on the H200 (on the CPU: a check that they agree)

`ragged.write_ring` stores each token's row at (slot, position mod R) if it is among the
last R positions of its sequence in the step, dropping the rest. On the H200 an 8k-token
prefill step spent 2.8 ms per layer in each of two such scatter fusions, and 14 ms once their
indices were declared unique (which batch-invariant mode needs: under XLA's deterministic
ops an undeclared scatter runs as a serial loop). Variants of the same write, on a ring of
`--slots` sequences of R = 128 rows (bf16 x 512 like the window ring, float32 x 512 like a
compressor tail), for a prefill (one sequence of `--prefill` tokens) and a decode batch:

- set: `ragged.write_ring` as the default mode runs it;
- set unique: as batch-invariant mode runs it (indices declared unique, every dropped row at
  one index past the end);
- set unique, distinct drops: each dropped row at its own index past the end;
- kept first: the updates compacted (kept rows first, a stable argsort) and cut to the most a
  step can keep (slots x R, or T), then the unique scatter;
- gather: no scatter of rows: each ring row's source token found by a scatter of token ids
  (4 bytes per token instead of a row), then `where(written, values[source], ring)`.

Device time per write (profiler), the write repeated inside one jitted loop so that the ring
is updated in place as in the step; then compiled as batch-invariant mode compiles its steps
(`xla_gpu_deterministic_ops`, where "set" is a serial loop and is left out).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import environment, write_results  # noqa: E402
from bench.device_time import device_ms  # noqa: E402
from deepinfer_jax.engine.compile import BATCH_INVARIANT_COMPILER_OPTIONS  # noqa: E402
from deepinfer_jax.model.ragged import TokenContext, write_ring  # noqa: E402

R = 128


def destinations(slot, positions, end, slots):
    keep = positions >= end - R
    return keep, jnp.where(keep, slot * R + positions % R, slots * R)


def set_rows(flat, values, slot, positions, end, unique=False, distinct_drops=False):
    if not distinct_drops:      # the engine's own write (ragged.write_ring)
        ctx = TokenContext(positions=positions, valid=jnp.ones_like(positions, bool),
                           seq=slot, slot=slot, start=positions, end=end,
                           block_table=jnp.zeros((1, 1), jnp.int32))
        ring = flat.reshape(-1, R, flat.shape[-1])
        return write_ring(ring, values, ctx, order_free=unique).reshape(flat.shape)
    keep, dest = destinations(slot, positions, end, flat.shape[0] // R)
    dest = jnp.where(keep, dest, flat.shape[0] + jnp.arange(dest.shape[0]))
    return flat.at[dest].set(values, mode="drop", unique_indices=unique)


def kept_first(flat, values, slot, positions, end):
    keep, dest = destinations(slot, positions, end, flat.shape[0] // R)
    most = min(dest.shape[0], flat.shape[0])
    order = jnp.argsort(~keep, stable=True)[:most]
    return flat.at[dest[order]].set(values[order], mode="drop", unique_indices=True)


def gather(flat, values, slot, positions, end):
    _, dest = destinations(slot, positions, end, flat.shape[0] // R)
    source = jnp.full(flat.shape[0], -1, jnp.int32).at[dest].set(
        jnp.arange(dest.shape[0], dtype=jnp.int32), mode="drop", unique_indices=True)
    return jnp.where((source >= 0)[:, None], values[jnp.maximum(source, 0)], flat)


VARIANTS = {
    "set": set_rows,
    "set unique": lambda *a: set_rows(*a, unique=True),
    "set unique, distinct drops": lambda *a: set_rows(*a, unique=True, distinct_drops=True),
    "kept first": kept_first,
    "gather": gather,
}


def case(kind: str, tokens: int, slots: int):
    """(slot, positions, end) of a prefill of one sequence or a decode batch."""
    if kind == "prefill":
        positions = jnp.arange(tokens, dtype=jnp.int32)
        return jnp.zeros(tokens, jnp.int32), positions, jnp.full(tokens, tokens, jnp.int32)
    slot = jnp.arange(tokens, dtype=jnp.int32) % slots
    positions = jnp.full(tokens, 4096, jnp.int32)
    return slot, positions, positions + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10, help="writes per jitted call")
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu:
        args.slots, args.prefill, args.decode, args.repeats = 8, 512, 8, 2
    rows = []
    for dtype in (jnp.bfloat16, jnp.float32):
        for kind, tokens in (("prefill", args.prefill), ("decode", args.decode)):
            rng = np.random.default_rng(0)
            ring = jnp.asarray(rng.standard_normal((args.slots * R, 512)), dtype)
            values = jnp.asarray(rng.standard_normal((tokens, 512)), dtype)
            where = case(kind, tokens, args.slots)
            expected = None
            for name, write in VARIANTS.items():
                def repeated(ring, values, slot, positions, end, write=write):
                    return jax.lax.fori_loop(0, args.repeats, lambda _, r: write(
                        r, values, slot, positions, end), ring)

                fn = jax.jit(repeated)
                out = np.asarray(fn(ring, values, *where).astype(jnp.float32))
                expected = out if expected is None else expected
                same = bool(np.array_equal(out, expected))
                ms = deterministic_ms = None
                if on_gpu:
                    ms = device_ms(fn, ring, values, *where) / args.repeats
                    if name != "set":
                        invariant = fn.lower(ring, values, *where).compile(
                            compiler_options=BATCH_INVARIANT_COMPILER_OPTIONS)
                        deterministic_ms = device_ms(invariant, ring, values,
                                                     *where) / args.repeats
                rows.append({"dtype": jnp.dtype(dtype).name, "case": kind, "tokens": tokens,
                             "variant": name, "same_as_set": same, "device_ms": ms,
                             "deterministic_ops_device_ms": deterministic_ms})
                print(rows[-1], flush=True)
    if not all(r["same_as_set"] for r in rows):
        raise SystemExit("a variant wrote a different ring")
    if not on_gpu:
        print("all variants agree (timings are for a GPU)")
        return
    table = ("| ring | case | tokens | variant | device ms per write | with deterministic ops |\n"
             "|---|---|---:|---|---:|---:|\n")
    for r in rows:
        det = r["deterministic_ops_device_ms"]
        table += (f"| {r['dtype']} x 512, {args.slots} x {R} rows | {r['case']} | {r['tokens']} "
                  f"| {r['variant']} | {r['device_ms']:.3f} | "
                  f"{'serial loop' if det is None else f'{det:.3f}'} |\n")
    command = "python bench/ring_writes.py " + " ".join(sys.argv[1:])
    write_results("ring-writes-gpu", {"environment": environment(), "rows": rows,
                                      "command": command}, table + f"\nCommand: `{command}`.")
    print(table)


if __name__ == "__main__":
    main()
