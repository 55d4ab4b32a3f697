"""The cost of batch-invariant mode: decode and prefill throughput, default vs invariant.

    python bench/batch_invariant.py                           # CPU: small model, short prefill
    python bench/batch_invariant.py --v4-flash-layers 2 --prefill 8192 --decode-batch 64  # GPU

Decode: tokens/s in steady state at the given batch. Prefill: tokens/s of one long prompt
processed in chunks of the engine's budget. Both engines use the same model and shapes; the
output marks which rows ran in batch-invariant mode.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.engine_loop import steady_decode  # noqa: E402
from bench.lib.models import SMALL_CPU, model_config, model_label  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from deepinfer_jax import LLM, Model, SamplingParams  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402


def prefill_rate(llm: LLM, length: int) -> float:
    prompt = np.random.default_rng(1).integers(2, llm.model.config.vocab_size, length).tolist()
    llm.generate([prompt[:64]], SamplingParams(max_tokens=1), use_tqdm=False)      # warm-up
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    return length / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=SMALL_CPU)
    ap.add_argument("--v4-flash-layers", type=int, default=0)
    ap.add_argument("--decode-batch", type=int, default=64)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--buckets", type=int, nargs="+", default=None,
                    help="token buckets to compile (default: powers of two up to --chunk)")
    args = ap.parse_args()
    cfg = model_config(args)
    model = Model(cfg, random_params(cfg, 0, jnp.bfloat16))
    rows = []
    for invariant in (False, True):
        llm = LLM(model, batch_invariant=invariant, max_num_seqs=args.decode_batch,
                  max_model_len=args.prefill + 64, max_num_batched_tokens=args.chunk,
                  token_buckets=args.buckets and tuple(args.buckets),
                  compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
        decode = steady_decode(llm, args.decode_batch, args.steps)
        tile = llm.engine.step_cfg.compute.invariant_tile
        rows.append({"batch_invariant": invariant,
                     "decode_tokens_per_s": args.decode_batch / (decode["wall_ms"] / 1e3),
                     "prefill_tokens_per_s": prefill_rate(llm, args.prefill)})
        print(rows[-1], flush=True)
        del llm
    base, inv = rows
    cost = {k: 1 - inv[k] / base[k] for k in ("decode_tokens_per_s", "prefill_tokens_per_s")}
    device = jax.devices()[0].platform
    label = model_label(args, cfg)
    payload = {"model": label, "decode_batch": args.decode_batch, "prefill_tokens": args.prefill,
               "chunk": args.chunk, "results": rows, "slowdown": cost}
    table = ("| mode | decode tok/s (batch {b}) | prefill tok/s ({p} tokens) |\n|---|---:|---:|\n"
             .format(b=args.decode_batch, p=args.prefill))
    for r in rows:
        table += (f"| {'batch-invariant' if r['batch_invariant'] else 'default'} | "
                  f"{r['decode_tokens_per_s']:.0f} | {r['prefill_tokens_per_s']:.0f} |\n")
    table += (f"\nSlowdown of the batch-invariant mode: decode {cost['decode_tokens_per_s']:.0%}, "
              f"prefill {cost['prefill_tokens_per_s']:.0%}. Model: {label}, random bf16 weights.")
    payload["invariant_tile"] = tile
    default_tile = 8 if device == "cpu" else 64          # config/options.py's per device
    suffix = "" if tile == default_tile else f"-tile{tile}"   # a variant's own file
    write_results(f"batch-invariant-{device}{suffix}", payload, table)
    print(table)


if __name__ == "__main__":
    main()
