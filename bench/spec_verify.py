"""Speculative decoding at real dimensions: the verify step's cost for 1-5 drafts against a
plain step, and the speed-up the trained tiny model's acceptance implies.

    python bench/spec_verify.py                                        # CPU: small config
    python bench/spec_verify.py --v4-flash-layers 4 --quantized --batches 1 16 64   # GPU

1. Acceptance: the shipped trained model (models/deepinfer-tiny-v4) completes bench/
   speculative.py's held-out prompts greedily with exactly k drafts per step (confidence cut
   off, every draft verified); the tokens each verify step emits are counted per k.
2. Cost: the model of the given dimensions with one MTP layer (random weights) decodes at a
   `--context`-token context; per k, the engine loop's median wall time per step with k
   drafts per request forced, beside the plain engine's. Random weights accept almost nothing,
   but a step's cost does not depend on what it accepts: its shapes are fixed by k and the
   batch (the acceptance is imposed, not measured, on the large model).
3. Implied speed-up(k, batch) = tokens per verify step (tiny model, k) x plain ms / verify ms.

The outputs are checked: the tiny model's speculative greedy tokens must equal its plain ones
(batch-invariant mode; the run fails otherwise); the large model's are compared in the default
mode and the count of equal requests reported (there a bf16 near-tie may flip a token).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.engine_loop import abort_all, step_until_decoding  # noqa: E402
from bench.lib.models import SMALL_CPU, V4_FLASH, engine_params, model_label, slice_config  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402
from bench.lib.timing import MIN_REPEATS  # noqa: E402
from bench.speculative import MODEL as TINY  # noqa: E402
from bench.speculative import prompts as held_out_prompts  # noqa: E402
from deepinfer_jax import LLM, Model, SamplingParams  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402


def forced(k: int, batch: int, token_map: str | None = None) -> dict:
    """k drafts for every request of the batch, every step: no confidence cut, a budget that
    covers them all; with `token_map`, drafted from those ids only."""
    return {"num_speculative_tokens": k, "varlen": False, "confidence_threshold": 0.0,
            "verify_token_budget": k * batch, "draft_token_map": token_map}


def write_token_map(ids: list[int], name: str) -> str:
    path = REPO / ".cache" / "bench" / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ids))
    return str(path)


def tiny_token_map(fraction: float) -> str:
    """The tiny model's most frequent tokens on its training text (tools/draft_token_map.py),
    `fraction` of its vocabulary."""
    sys.path.insert(0, str(REPO / "tools"))
    from draft_token_map import corpus_tokens, most_frequent

    vocab = read_model_config(TINY).vocab_size
    ids = most_frequent(corpus_tokens(TINY, []), vocab, round(fraction * vocab))
    return write_token_map(ids, f"tiny-draft-map-{fraction:g}")


def tiny_acceptance(ks: list[int], batch: int, tokens: int, token_map: str | None = None
                    ) -> dict:
    """k -> tokens per verify step of the trained tiny model, and whether its speculative
    outputs equal its plain ones (with `token_map`: drafting from those ids only)."""
    # batch-invariant: a verify step's rows then round as plain steps' do, so speculative
    # greedy outputs must equal plain ones exactly (in the default mode a bf16 near-tie may
    # flip: bench/results/speculative-cpu.md)
    common = dict(max_num_seqs=batch, max_model_len=512, max_num_batched_tokens=256,
                  batch_invariant=True, compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    plain = LLM(TINY, **common)
    ps = held_out_prompts(plain.tokenizer, batch)
    reference = [o.token_ids for o in plain.generate(ps, params, use_tqdm=False)]
    del plain
    out = {}
    for k in ks:
        llm = LLM(TINY, speculative_config=forced(k, batch, token_map), **common)
        got = [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)]
        m = llm.spec_metrics
        out[k] = {"tokens_per_verify_step": (m.accepted + m.steps) / m.steps,
                  "acceptance_rate": m.accepted / m.drafted,
                  "outputs_equal": sum(a == b for a, b in zip(got, reference))}
        print("tiny", k, out[k], flush=True)
        if out[k]["outputs_equal"] != batch:
            raise SystemExit(f"k={k}: speculative outputs differ from plain ones on "
                             f"{batch - out[k]['outputs_equal']} of {batch} prompts")
        del llm
        gc.collect()
    return out


def acceptance_from(path: Path, ks: list[int]) -> dict:
    """tiny_acceptance's result as an earlier run measured it (its JSON's `tiny_acceptance`),
    for every k asked."""
    measured = {int(k): v for k, v in json.loads(path.read_text())["tiny_acceptance"].items()}
    missing = sorted(set(ks) - set(measured))
    if missing:
        raise SystemExit(f"{path} has no tiny-model acceptance for k = {missing}")
    return {k: measured[k] for k in ks}


def step_ms(llm: LLM, batch: int, context: int, steps: int, rng) -> dict:
    """Median and spread of the loop's wall time per step, `batch` requests decoding at about
    `context` tokens (each its own prompt: no prefix sharing, so that MTP's state is each
    request's own)."""
    engine, vocab = llm.engine, llm.model.config.vocab_size
    params = SamplingParams(max_tokens=engine.step_cfg.max_model_len - context, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{i}", rng.integers(2, vocab, context).tolist(), params)
    step_until_decoding(engine, batch)
    samples, emitted = [], 0
    before = sum(len(r.generated) for r in engine.scheduler.running)
    for _ in range(max(steps, MIN_REPEATS)):
        start = time.perf_counter()
        engine.step()
        samples.append((time.perf_counter() - start) * 1e3)
    emitted = sum(len(r.generated) for r in engine.scheduler.running) - before
    abort_all(engine)
    return {"ms": statistics.median(samples), "ms_min": min(samples), "ms_max": max(samples),
            "repeats": len(samples), "tokens_per_step": emitted / len(samples) / batch}


def pow2_at_least(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    out = llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True),
                       use_tqdm=False)
    return [o.token_ids for o in out]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=SMALL_CPU)
    ap.add_argument("--v4-flash-layers", type=int, default=0)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 5])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--check-tokens", type=int, default=32)
    ap.add_argument("--tiny-tokens", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--quantized", action="store_true",
                    help="random weights in the release's formats (a 4-layer slice's bf16 "
                         "experts and MTP layer do not fit an H100's 80 GB)")
    ap.add_argument("--acceptance-from", type=Path, default=None,
                    help="a spec-verify result file (.json) whose tiny-model acceptance to use "
                         "instead of measuring it again (the GPU run then compiles 4 engines "
                         "fewer)")
    ap.add_argument("--draft-vocab-fraction", type=float, default=None,
                    help="draft from a token map of this share of the vocabulary "
                         "(speculative_config.draft_token_map): the tiny model's most frequent "
                         "tokens for its acceptance; for the timed model its first ids (a step's "
                         "cost depends on the map's size only)")
    ap.add_argument("--name", default=None,
                    help="the result files' name (default spec-verify-<platform>)")
    args = ap.parse_args()

    fraction = args.draft_vocab_fraction
    acceptance = (tiny_acceptance(args.ks, 8, args.tiny_tokens,
                                  None if fraction is None else tiny_token_map(fraction))
                  if args.acceptance_from is None
                  else acceptance_from(args.acceptance_from, args.ks))
    base = (slice_config(V4_FLASH, args.v4_flash_layers) if args.v4_flash_layers
            else read_model_config(args.config))
    cfg = dataclasses.replace(base, num_mtp_layers=1)
    weights = engine_params(jax.block_until_ready(random_params(
        cfg, 0, jnp.bfloat16, release_formats=args.quantized)))
    token_map = (None if fraction is None else
                 write_token_map(list(range(round(fraction * cfg.vocab_size))),
                                 f"first-ids-{fraction:g}"))
    batch_max, k_max = max(args.batches), max(args.ks)
    budget = max(1024, batch_max * (k_max + 1))
    # tokens the first request may emit while the batch's other prompts prefill (no prefix
    # shared): step_until_decoding needs it still running when the last joins
    reach = -(-batch_max * args.context // budget) * (k_max + 1)

    def shapes(k: int) -> dict:
        """Only the buckets the run's steps use (prefill chunks, each batch's plain or verify
        step): a V4-Flash slice takes tens of seconds a bucket to compile."""
        need = {16, budget} | {max(16, pow2_at_least(b * (k + 1))) for b in args.batches}
        return dict(max_num_seqs=batch_max, max_model_len=args.context + 128 + reach,
                    max_num_batched_tokens=budget, token_buckets=tuple(sorted(need)),
                    gpu_memory_utilization=args.gpu_memory_utilization,
                    compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
    rng = np.random.default_rng(0)
    check = [rng.integers(2, cfg.vocab_size, 64).tolist() for _ in range(4)]
    rows = []
    plain = LLM(Model(cfg, weights), **shapes(0))
    reference = greedy(plain, check, args.check_tokens)
    plain_ms = {b: step_ms(plain, b, args.context, args.steps, rng) for b in args.batches}
    del plain
    gc.collect()
    for k in args.ks:             # one engine per k: the budget gives every batch k drafts
        llm = LLM(Model(cfg, weights), speculative_config=forced(k, batch_max, token_map),
                  **shapes(k))
        equal = sum(a == r for a, r in zip(greedy(llm, check, args.check_tokens), reference))
        for b in args.batches:
            t = step_ms(llm, b, args.context, args.steps, rng)
            tiny = acceptance[k]["tokens_per_verify_step"]
            rows.append({"k": k, "batch": b, "plain": plain_ms[b], "verify": t,
                         "cost_ratio": t["ms"] / plain_ms[b]["ms"], "tiny_tokens_per_step": tiny,
                         "implied_speedup": tiny * plain_ms[b]["ms"] / t["ms"],
                         "outputs_equal": f"{equal}/{len(check)}"})
            print(rows[-1], flush=True)
        del llm
        gc.collect()
    label = model_label(args, base) + " + 1 MTP layer, random weights " + (
        "in the release's formats (FP8 projections, FP4 routed experts)" if args.quantized
        else "in bf16") + ("" if fraction is None else
                           f"; drafts from a token map of {fraction:g} of the vocabulary")
    payload = {"environment": environment(), "model": label, "context": args.context,
               "draft_vocab_fraction": fraction,
               "tiny_acceptance": acceptance, "tiny_acceptance_from": (
                   None if args.acceptance_from is None else str(args.acceptance_from)),
               "rows": rows}
    lines = [f"Model: {label}; decode at a {args.context}-token context; the engine loop's "
             f"wall time per step, median of {max(args.steps, MIN_REPEATS)} (min-max).", "",
             "| k drafts | batch | plain ms/step | verify ms/step | cost vs plain | tiny model "
             "tokens/verify step | implied speed-up | spec = plain outputs |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p, v = r["plain"], r["verify"]
        lines.append(f"| {r['k']} | {r['batch']} | {p['ms']:.2f} ({p['ms_min']:.2f}-"
                     f"{p['ms_max']:.2f}) | {v['ms']:.2f} ({v['ms_min']:.2f}-{v['ms_max']:.2f}) "
                     f"| {r['cost_ratio']:.2f}x | {r['tiny_tokens_per_step']:.2f} | "
                     f"{r['implied_speedup']:.2f}x | {r['outputs_equal']} |")
    source = ("measured in this run" if args.acceptance_from is None
              else f"as measured in {args.acceptance_from.name}")
    drafted_from = ("" if fraction is None else
                    f", drafts from its {fraction:g} most frequent share of the vocabulary")
    lines += ["", f"Tiny model ({source}; models/deepinfer-tiny-v4, greedy, 8 held-out prompts, "
              f"{args.tiny_tokens} tokens, exactly k drafts a step{drafted_from}): " + ", ".join(
                  f"k={k}: {a['tokens_per_verify_step']:.2f} tokens/step, outputs equal "
                  f"{a['outputs_equal']}/8" for k, a in acceptance.items())]
    write_results(args.name or f"spec-verify-{jax.devices()[0].platform}", payload,
                  "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
