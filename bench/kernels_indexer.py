"""The lightning indexer's scores and top-k on DeepSeek-V4-Flash shapes: the engine's XLA path
(keys gathered per token, a float32 dot, the sum over heads) against the Mosaic GPU kernel
(keys gathered once per sequence, heads folded in the kernel), in one run.

    python bench/kernels_indexer.py                  # H200
    python bench/kernels_indexer.py --smoke          # CPU: tiny shapes, kernel interpreted

64 indexer heads of 128, compressed rows every 4 tokens, top-512. Cases: an 8k-token prefill
chunk of one sequence at 8k context, and decode batches of 16 and 64 sequences at 4k / 32k
context. Device ms from the profiler, each path from the paged pool to the top-k indices.
`top-k agree` is the share of the kernel path's selected rows that the float32 path selects
too (the kernel takes bf16 queries, as HF's are; the engine's CPU path keeps float32);
`scores rel err` the kernel's scores against the jnp reference on the same bf16 queries.
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

from bench.lib.device_time import device_timing  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from deepinfer_jax.model.indexer import index_scores  # noqa: E402
from pallas_kernels.indexer import api, reference  # noqa: E402

HEADS, DIM, RATE, TOPK = 64, 128, 4, 512


def problem(seqs: int, tokens_per_seq: int, context: int, seed: int = 0):
    """A pool holding each sequence's rows contiguously, its block table being row ranges;
    each token at the end of its sequence's context."""
    rng = np.random.default_rng(seed)
    rows = context // RATE
    pool = jnp.asarray(rng.standard_normal((seqs * rows, DIM)), jnp.bfloat16)
    tokens = seqs * tokens_per_seq
    q = jnp.asarray(rng.standard_normal((tokens, HEADS, DIM)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((tokens, HEADS)), jnp.float32) * HEADS ** -0.5
    seq = jnp.repeat(jnp.arange(seqs, dtype=jnp.int32), tokens_per_seq)
    positions = context - tokens_per_seq + jnp.tile(jnp.arange(tokens_per_seq), seqs)
    visible = jnp.arange(rows)[None, :] < (positions[:, None] + 1) // RATE
    return pool, q, w, seq, visible, rows


def xla_path(pool, q, w, seq, visible, rows):
    keys = pool[seq[:, None] * rows + jnp.arange(rows)]                        # [T, R, d]
    scores = index_scores(q[:, None], w[:, None], keys.astype(jnp.float32))[:, 0]
    return jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), min(TOPK, rows))[1]


def kernel_path(impl, pool, q, w, seq, visible, rows):
    keys = pool.reshape(-1, rows, DIM)                                          # per sequence
    scores = api.indexer_scores(q.astype(jnp.bfloat16), keys, w, seq, implementation=impl)
    return jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), min(TOPK, rows))[1]


def scores_error(impl, pool, q, w, seq, rows) -> float:
    """The kernel's scores against the reference's on the same bf16 queries (relative)."""
    keys = pool.reshape(-1, rows, DIM)
    qb = q.astype(jnp.bfloat16)
    out = api.indexer_scores(qb, keys, w, seq, implementation=impl)
    ref = reference.indexer_scores(qb, keys, w, seq)
    return float(jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30))


def agreement(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.mean([len(np.intersect1d(x, y)) / len(x) for x, y in zip(a, b)]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    impl = "interpret" if args.smoke else "mosaic_gpu"
    cases = ([("prefill", 1, 64, 256), ("decode", 4, 1, 512)] if args.smoke else
             [("prefill 8k", 1, 8192, 8192), ("decode 16, 4k ctx", 16, 1, 4096),
              ("decode 64, 4k ctx", 64, 1, 4096), ("decode 16, 32k ctx", 16, 1, 32768),
              ("decode 64, 32k ctx", 64, 1, 32768)])
    results = []
    for name, seqs, per_seq, context in cases:
        pool, q, w, seq, visible, rows = problem(seqs, per_seq, context)
        xla = jax.jit(xla_path, static_argnums=5)
        kern = jax.jit(lambda *a: kernel_path(impl, *a), static_argnums=5)
        args_ = (pool, q, w, seq, visible, rows)
        xla_t, kern_t = device_timing(xla, *args_), device_timing(kern, *args_)
        row = {"case": name, "tokens": seqs * per_seq, "rows": rows,
               "xla_ms": xla_t.ms, "xla": xla_t.row(), "kernel_ms": kern_t.ms,
               "kernel": kern_t.row(),
               "topk_agree": agreement(kern(*args_), xla(*args_)),
               "rel_err": scores_error(impl, pool, q, w, seq, rows)}
        results.append(row)
        print(row, flush=True)
    table = "\n".join(["| case | tokens | key rows | XLA path ms | kernel path ms | speed-up | "
                       "top-k agree | scores rel err |", "|---|---:|---:|---:|---:|---:|---:|---:|"] +
                      [f"| {r['case']} | {r['tokens']} | {r['rows']} | {r['xla_ms']:.3f} | "
                       f"{r['kernel_ms']:.3f} | {r['xla_ms'] / r['kernel_ms']:.1f}x | "
                       f"{r['topk_agree']:.1%} | {r['rel_err']:.1e} |" for r in results])
    note = (f"\n\n64 heads of {DIM}, a row per {RATE} tokens, top-{TOPK}; device ms: the median "
            "over 20 traced calls of each call's kernel time (min-max in the JSON), each path "
            "from the paged pool to the top-k indices.")
    name = "kernels-indexer-cpu-smoke" if args.smoke else "kernels-indexer-gpu"
    write_results(name, {"results": results}, table + note)
    print(table)


if __name__ == "__main__":
    main()
