"""MTP speculative decoding on the shipped tiny model: output tokens/s with and without it.

    python bench/speculative.py [--batches 1 8 64] [--tokens 128]
    python bench/speculative.py --loops [--batches 1 8] [--tokens 128]

For each batch size, the same prompts (the first lines of held-out stdlib modules) are
completed greedily with and without speculation; the table gives output tokens/s, the
speed-up, and the acceptance figures (drafted, accepted, mean tokens per verify step).
With --loops, speculation on in both, the synchronous loop against the asynchronous one (which
plans step N+1 while step N runs, its drafts and accepted counts carried on the device:
host/spec_booking.py), and the share of steps the asynchronous loop planned before reading
the last one.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from pathlib import Path

import jax

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.results import environment, write_results  # noqa: E402
from deepinfer_jax import LLM, SamplingParams  # noqa: E402

MODEL = REPO / "models" / "deepinfer-tiny-v4"
MODULES = ["json/decoder.py", "email/utils.py", "http/cookies.py", "logging/handlers.py",
           "argparse.py", "textwrap.py", "csv.py", "statistics.py", "fractions.py", "heapq.py",
           "bisect.py", "dataclasses.py", "string.py", "shlex.py", "calendar.py", "difflib.py"]


def prompts(tokenizer, n: int, length: int = 96) -> list[list[int]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    ids = [tokenizer.encode((root / m).read_text())[:length] for m in MODULES]
    return [ids[i % len(ids)] for i in range(n)]


def run(llm: LLM, batch: int, tokens: int) -> dict:
    ps = prompts(llm.tokenizer, batch)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    llm.generate(ps[:1], SamplingParams(max_tokens=4), use_tqdm=False)          # warm-up
    before = llm.spec_metrics.steps, llm.spec_metrics.drafted, llm.spec_metrics.accepted
    start = time.perf_counter()
    out = llm.generate(ps, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    m = llm.spec_metrics
    steps, drafted, accepted = (m.steps - before[0], m.drafted - before[1],
                                m.accepted - before[2])
    return {"tokens_per_s": sum(len(o.token_ids) for o in out) / elapsed, "verify_steps": steps,
            "drafted": drafted, "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_verify_step": (accepted + steps) / steps if steps else 1.0,
            "outputs": [o.token_ids for o in out]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--buckets", type=int, nargs="+", default=None,
                    help="token buckets to compile (default: powers of two up to the budget)")
    ap.add_argument("--loops", action="store_true",
                    help="speculation on: the synchronous loop against the asynchronous one")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="batch-invariant mode (outputs independent of the step's batching)")
    args = ap.parse_args()
    common = dict(max_num_seqs=max(args.batches), max_model_len=512,
                  max_num_batched_tokens=max(2 * max(args.batches), 256),
                  token_buckets=args.buckets and tuple(args.buckets),
                  compilation_cache_dir=str(REPO / ".cache" / "xla-bench"),
                  batch_invariant=args.batch_invariant)
    if args.loops:
        return compare_loops(args, common)
    base = LLM(MODEL, **common)
    spec = LLM(MODEL, speculative_config={"num_speculative_tokens": args.k}, **common)
    rows = []
    for batch in args.batches:
        b, s = run(base, batch, args.tokens), run(spec, batch, args.tokens)
        same = sum(x == y for x, y in zip(b.pop("outputs"), s.pop("outputs")))
        rows.append({"batch": batch, "baseline_tokens_per_s": b["tokens_per_s"],
                     "mtp_tokens_per_s": s["tokens_per_s"],
                     "speedup": s["tokens_per_s"] / b["tokens_per_s"],
                     "outputs_equal": f"{same}/{batch}", **{k: v for k, v in s.items()
                                                             if k != "tokens_per_s"}})
        print(rows[-1], flush=True)
    device = jax.devices()[0].platform
    payload = {"environment": environment(), "model": "models/deepinfer-tiny-v4",
               "num_speculative_tokens": args.k, "max_tokens": args.tokens, "results": rows}
    table = ("| batch | tok/s without | tok/s with MTP | speed-up | acceptance | tokens/verify "
             "step | greedy outputs equal |\n|---:|---:|---:|---:|---:|---:|---:|\n")
    for r in rows:
        table += (f"| {r['batch']} | {r['baseline_tokens_per_s']:.0f} | {r['mtp_tokens_per_s']:.0f} "
                  f"| {r['speedup']:.2f}x | {r['acceptance_rate']:.0%} | "
                  f"{r['tokens_per_verify_step']:.2f} | {r['outputs_equal']} |\n")
    table += (f"\nGreedy, {args.tokens} tokens per request, up to {args.k} drafts per step "
              "(confidence threshold 0.3, verify budget 32 draft tokens per step: plain steps "
              "past 32 requests).")
    write_results(f"speculative-{device}", payload, table)
    print(table)


def overlapped(llm: LLM) -> list[int]:
    """Count, in [steps planned, steps planned with a step in flight], the engine's steps
    from now on (a step planned before the last one's tokens were read)."""
    engine, counts = llm.engine, [0, 0]
    schedule = engine.scheduler.schedule

    def counting(*args, **kwargs):
        decision = schedule(*args, **kwargs)
        counts[0] += bool(decision.seqs)
        counts[1] += bool(decision.seqs) and bool(engine._in_flight)
        return decision

    engine.scheduler.schedule = counting
    return counts


def compare_loops(args, common: dict) -> None:
    spec = {"num_speculative_tokens": args.k}
    loops = {name: LLM(MODEL, speculative_config=spec, async_scheduling=name == "async",
                       **common) for name in ("sync", "async")}
    rows = []
    for batch in args.batches:
        counts = overlapped(loops["async"])
        s, a = run(loops["sync"], batch, args.tokens), run(loops["async"], batch, args.tokens)
        same = sum(x == y for x, y in zip(s.pop("outputs"), a.pop("outputs")))
        rows.append({"batch": batch, "sync_tokens_per_s": s["tokens_per_s"],
                     "async_tokens_per_s": a["tokens_per_s"],
                     "speedup": a["tokens_per_s"] / s["tokens_per_s"],
                     "overlapped_steps": f"{counts[1]}/{counts[0]}", "outputs_equal": f"{same}/{batch}",
                     "sync_acceptance_rate": s["acceptance_rate"],
                     "async_acceptance_rate": a["acceptance_rate"]})
        print(rows[-1], flush=True)
    device = jax.devices()[0].platform
    payload = {"environment": environment(), "model": "models/deepinfer-tiny-v4",
               "num_speculative_tokens": args.k, "max_tokens": args.tokens, "results": rows}
    table = ("| batch | tok/s sync loop | tok/s async loop | speed-up | steps planned with one in "
             "flight | acceptance sync / async | greedy outputs equal |\n"
             "|---:|---:|---:|---:|---:|---:|---:|\n")
    for r in rows:
        table += (f"| {r['batch']} | {r['sync_tokens_per_s']:.0f} | {r['async_tokens_per_s']:.0f} "
                  f"| {r['speedup']:.2f}x | {r['overlapped_steps']} | "
                  f"{r['sync_acceptance_rate']:.0%} / {r['async_acceptance_rate']:.0%} | "
                  f"{r['outputs_equal']} |\n")
    table += (f"\nMTP speculation on in both loops; greedy, {args.tokens} tokens per request, up "
              f"to {args.k} drafts per step (confidence threshold 0.3, verify budget 32).")
    mode = "-invariant" if args.batch_invariant else ""
    table += " Batch-invariant mode." if args.batch_invariant else ""
    write_results(f"speculative-loops{mode}-{device}", payload, table)
    print(table)


if __name__ == "__main__":
    main()
