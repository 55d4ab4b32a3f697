"""The cost of batch-invariant mode: decode and prefill throughput, default vs invariant.

    python bench/batch_invariant.py                           # CPU: small model, short prefill
    python bench/batch_invariant.py --v4-flash-layers 2 --prefill 8192 --decode-batches 64  # GPU
    python bench/batch_invariant.py --v4-flash-layers 2 --prefill 8192 --chunk 8192 \
        --context 4096 --decode-batches 16 64             # GPU, the e2e settings

Decode: tokens/s in steady state at each batch, with `--context` > 0 at that context (requests
sharing a prefix, bench/lib/decode.py), else from 16-token prompts. Prefill: tokens/s of one
long prompt processed in chunks of the engine's budget, the median of `--repeats` runs. Both
engines use the same model and shapes; the output marks which rows ran in batch-invariant mode.

The outputs are checked, in each mode: one prompt's greedy tokens and logprobs alone against the
same prompt among as many others as the largest decode batch (prompts of other lengths, so its
rows share steps with prefill chunks and decode rows). The invariant engine must give them
bitwise (the run fails otherwise); the default engine's difference is reported, and the two
modes' logprobs of the prompt alone are compared within bf16's rounding.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.decode import decode  # noqa: E402
from bench.lib.engine_loop import prefill_seconds, steady_decode  # noqa: E402
from bench.lib.models import SMALL_CPU, model_config, model_label  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402
from bench.lib.timing import MIN_REPEATS  # noqa: E402
from deepinfer_jax import LLM, Model, SamplingParams  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402


def prefill_rates(llm: LLM, length: int, repeats: int) -> list[float]:
    """tokens/s of `repeats` prefills of a fresh `length`-token prompt (no prefix hit)."""
    return [length / s for s in prefill_seconds(llm, length, repeats, np.random.default_rng(1))]


def decode_rate(llm: LLM, batch: int, context: int, steps: int) -> float:
    if not context:
        return batch / (steady_decode(llm, batch, steps)["wall_ms"] / 1e3)
    # the median step: decode() times each step of the window
    return batch / decode(llm, batch, context, steps, np.random.default_rng(2))["itl_p50_s"]


CHECK_TOKENS = 8
CHECK_LOGPROB_ATOL = 0.1     # the two modes round bf16 sums differently over 2+ layers


def outputs_check(llm: LLM, batch: int) -> dict:
    """A prompt's greedy tokens and logprobs alone and as the first of `batch` prompts."""
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(3)
    prompts = [rng.integers(2, vocab, int(n)).tolist() for n in rng.integers(8, 64, batch)]
    params = SamplingParams(max_tokens=CHECK_TOKENS, ignore_eos=True, logprobs=1)

    def read(output):
        return output.token_ids, [lp.logprob for lp in output.logprobs]

    alone = read(llm.generate(prompts[:1], params, use_tqdm=False)[0])
    together = read(llm.generate(prompts, params, use_tqdm=False)[0])
    diff = np.abs(np.subtract(alone[1], together[1]))
    return {"batch": batch, "tokens": alone[0], "logprobs": alone[1],
            "bitwise_alone_and_in_batch": alone == together,
            "max_logprob_diff_in_batch": float(diff.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=SMALL_CPU)
    ap.add_argument("--v4-flash-layers", type=int, default=0)
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[64])
    ap.add_argument("--context", type=int, default=0,
                    help="decode at this context (0: from 16-token prompts)")
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS)
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--name", default=None,
                    help="the result files' name (default batch-invariant-<platform>[-tileN])")
    ap.add_argument("--buckets", type=int, nargs="+", default=None,
                    help="token buckets to compile (default: powers of two up to --chunk)")
    args = ap.parse_args()
    cfg = model_config(args)
    model = Model(cfg, random_params(cfg, 0, jnp.bfloat16))
    rows = []
    for invariant in (False, True):
        llm = LLM(model, batch_invariant=invariant, max_num_seqs=max(args.decode_batches),
                  max_model_len=max(args.prefill, args.context + args.steps + 128) + 64,
                  max_num_batched_tokens=args.chunk,
                  # the shared prefix of --context's decode; off otherwise, as before (the
                  # snapshots a cache takes cost the prefill a little in either mode)
                  enable_prefix_caching=bool(args.context),
                  token_buckets=args.buckets and tuple(args.buckets),
                  compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
        tile = llm.engine.step_cfg.compute.invariant_tile
        check = outputs_check(llm, max(args.decode_batches))
        rates = prefill_rates(llm, args.prefill, args.repeats)
        rows.append({"batch_invariant": invariant,
                     "decode_tokens_per_s": {b: decode_rate(llm, b, args.context, args.steps)
                                             for b in args.decode_batches},
                     "prefill_tokens_per_s": statistics.median(rates),
                     "prefill_tokens_per_s_min": min(rates),
                     "prefill_tokens_per_s_max": max(rates), "outputs": check})
        print(rows[-1], flush=True)
        del llm
    base, inv = rows
    modes = np.abs(np.subtract(base["outputs"]["logprobs"], inv["outputs"]["logprobs"]))
    # The timings are written either way; a failed check then fails the run.
    failures = []
    if not inv["outputs"]["bitwise_alone_and_in_batch"]:
        failures.append(f"batch-invariant mode: the prompt's outputs alone and among "
                        f"{inv['outputs']['batch']} differ (max |logprob diff| "
                        f"{inv['outputs']['max_logprob_diff_in_batch']:.3g})")
    # (random weights: a near tie may pick another first token, whose logprob is then as close)
    if modes[0] > CHECK_LOGPROB_ATOL:
        failures.append(f"the two modes' first tokens' logprobs are {modes[0]:.3g} apart "
                        f"(tokens {base['outputs']['tokens'][0]} and "
                        f"{inv['outputs']['tokens'][0]})")
    cost = {"prefill": 1 - inv["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]} | {
        f"decode b{b}": 1 - inv["decode_tokens_per_s"][b] / base["decode_tokens_per_s"][b]
        for b in args.decode_batches}
    device = jax.devices()[0].platform
    label = model_label(args, cfg)
    where = f"at a {args.context}-token context" if args.context else "from 16-token prompts"
    payload = {"environment": environment(), "model": label,
               "decode_batches": args.decode_batches, "context": args.context,
               "prefill_tokens": args.prefill, "chunk": args.chunk, "results": rows,
               "slowdown": cost}
    table = ("| mode | " + " | ".join(f"decode tok/s (batch {b})" for b in args.decode_batches)
             + f" | prefill tok/s ({args.prefill} tokens, chunks of {args.chunk}) |\n|---|"
             + "---:|" * (len(args.decode_batches) + 1) + "\n")
    for r in rows:
        table += (f"| {'batch-invariant' if r['batch_invariant'] else 'default'} | "
                  + " | ".join(f"{r['decode_tokens_per_s'][b]:.0f}" for b in args.decode_batches)
                  + f" | {r['prefill_tokens_per_s']:.0f} ({r['prefill_tokens_per_s_min']:.0f}-"
                  f"{r['prefill_tokens_per_s_max']:.0f}) |\n")
    table += ("\nSlowdown of the batch-invariant mode: "
              + ", ".join(f"{k} {v:.0%}" for k, v in cost.items())
              + f". Model: {label}, random bf16 weights. Decode {where}, "
              + (f"the median of {args.steps} steps" if args.context else
                 f"the mean of {args.steps} steps") + f"; prefill median (min-max) of {args.repeats}.")
    default_check = base["outputs"]
    table += (f"\n\nOutputs: a prompt's {CHECK_TOKENS} greedy tokens alone and among "
              f"{default_check['batch']} prompts are "
              + ("bitwise equal" if inv["outputs"]["bitwise_alone_and_in_batch"] else
                 "**not** bitwise equal (the run failed)")
              + " in batch-invariant mode (checked); in the default mode "
              + ("bitwise equal too" if default_check["bitwise_alone_and_in_batch"]
                 else f"their logprobs differ by up to "
                      f"{default_check['max_logprob_diff_in_batch']:.3g}")
              + f". The two modes' first tokens' logprobs are {modes[0]:.3g} apart (at most "
              f"{CHECK_LOGPROB_ATOL} asked); the {CHECK_TOKENS} tokens "
              + ("equal" if default_check["tokens"] == inv["outputs"]["tokens"] else "not all equal")
              + f", their logprobs {float(modes.max()):.3g} apart at most.")
    payload["invariant_tile"] = tile
    default_tile = 8 if device == "cpu" else 64          # config/options.py's per device
    suffix = "" if tile == default_tile else f"-tile{tile}"   # a variant's own file
    payload["failures"] = failures
    write_results(args.name or f"batch-invariant-{device}{suffix}", payload, table)
    print(table)
    if failures:
        raise SystemExit("output checks failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
