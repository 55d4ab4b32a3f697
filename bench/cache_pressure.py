"""Admission under cache pressure: a batch whose requests need several times the page pool,
run as one batch and one by one, with the scheduler's admission (a request joins only while
the cache holds every running request to its end) and the old one (it joins whenever its
first chunk's pages are free, and decoding then preempts).

    python bench/cache_pressure.py          # CPU, the shipped tiny model, a few minutes

One engine per workload serves every run (each gets a fresh scheduler, so its preemption
count is its own); runs are interleaved, so that drifts hit every run alike. Greedy with
ignore_eos, in batch-invariant mode (a row's numbers do not depend on the batch it runs in):
every run must produce the same tokens, which the script asserts. Wall time is end to end
(`LLM.generate`), median and min-max over the repeats.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.admission import FirstChunkAdmission  # noqa: E402
from bench.lib.results import write_results  # noqa: E402
from deepinfer_jax import LLM, SamplingParams  # noqa: E402
from deepinfer_jax.host.pages import pages_needed  # noqa: E402
from deepinfer_jax.host.scheduler import Scheduler  # noqa: E402

RUNS = {"batch, reserve to the end (new)": (Scheduler, False),
        "batch, first chunk fits (old)": (FirstChunkAdmission, False),
        "one by one": (Scheduler, True)}


def run(llm: LLM, scheduler: type[Scheduler], one_by_one: bool, prompts, params) -> dict:
    engine = llm.engine
    engine.scheduler = scheduler(engine.step_cfg, engine.cfg.eos_token_ids)
    start = time.perf_counter()
    if one_by_one:
        outputs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    return {"wall_s": wall, "preemptions": engine.scheduler.num_preemptions,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def workload(llm: LLM, spec: dict, repeats: int) -> tuple[dict, str]:
    """Every run of one workload, interleaved; its summary and its table's rows."""
    vocab = llm.model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, vocab, spec["prompt_len"]).tolist()
               for _ in range(spec["num_requests"])]
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    rows = {name: [] for name in RUNS}
    for _ in range(repeats):
        for name, (scheduler, one_by_one) in RUNS.items():
            rows[name].append(run(llm, scheduler, one_by_one, prompts, params))
            print(spec, name, f"{rows[name][-1]['wall_s']:.2f} s",
                  rows[name][-1]["preemptions"], "preemptions", flush=True)
    reference = rows["one by one"][0]["tokens"]
    for name, runs in rows.items():
        for r in runs:
            differ = [i for i, (a, b) in enumerate(zip(r["tokens"], reference)) if a != b]
            assert not differ, f"{name}: greedy tokens differ in requests {differ}"
    summary = {}
    for name, runs in rows.items():
        walls = [r["wall_s"] for r in runs]
        summary[name] = {"wall_s_median": float(np.median(walls)), "wall_s_min": min(walls),
                         "wall_s_max": max(walls), "wall_s": walls,
                         "preemptions": [r["preemptions"] for r in runs]}
    alone = summary["one by one"]["wall_s_median"]
    label = f"{spec['prompt_len']} + {spec['max_tokens']}"
    table = ""
    for name, s in summary.items():
        table += (f"| {label} | {name} | {s['wall_s_median']:.2f} ({s['wall_s_min']:.2f}-"
                  f"{s['wall_s_max']:.2f}) | {s['wall_s_median'] / alone:.2f}x | "
                  f"{', '.join(map(str, sorted(set(s['preemptions']))))} |\n")
    return summary, table


def parse_workload(text: str) -> dict:
    prompt_len, max_tokens, num_requests, num_pages = map(int, text.split(":"))
    return {"prompt_len": prompt_len, "max_tokens": max_tokens, "num_requests": num_requests,
            "num_pages": num_pages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "models" / "deepinfer-tiny-v4")
    ap.add_argument("--workloads", nargs="+", type=parse_workload,
                    default=[parse_workload(w) for w in ("24:104:10:5", "176:80:8:10")],
                    help="PROMPT_LEN:MAX_TOKENS:NUM_REQUESTS:NUM_PAGES each")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    table = ("| prompt + generated | run | wall (s) | vs one by one | preemptions per run |\n"
             "|---|---|---:|---:|---:|\n")
    notes, results = [], []
    for spec in args.workloads:
        llm = LLM(args.model, max_num_seqs=args.max_num_seqs, max_model_len=256,
                  max_num_batched_tokens=32, page_size=args.page_size,
                  num_pages=spec["num_pages"], batch_invariant=True, show_progress=False)
        summary, rows = workload(llm, spec, args.repeats)
        del llm
        need = pages_needed(spec["prompt_len"] + spec["max_tokens"], args.page_size)
        spec = {**spec, "pages_per_request": need,
                "pool_in_sequences": spec["num_pages"] / need,
                "need_over_pool": spec["num_requests"] * need / spec["num_pages"]}
        results.append({**spec, "summary": summary})
        table += rows
        notes.append(f"- {spec['prompt_len']} + {spec['max_tokens']}: {spec['num_requests']} "
                     f"requests of {need} pages each; the pool holds {spec['num_pages']} pages "
                     f"({spec['pool_in_sequences']:.1f} sequences), the batch needs "
                     f"{spec['need_over_pool']:.1f}x the pool.")
    table = (f"Greedy with ignore_eos, batch-invariant mode, pages of {args.page_size} tokens, "
             f"{args.max_num_seqs} slots, a chunked-prefill budget of 32 tokens; model "
             f"`{args.model.relative_to(REPO)}`. Wall time of `LLM.generate` end to end, median "
             f"(min-max) of {args.repeats} interleaved runs; the same greedy tokens in every run "
             f"(asserted).\n\n" + "\n".join(notes) + "\n\n" + table)
    payload = {"model": str(args.model.relative_to(REPO)), "page_size": args.page_size,
               "max_num_seqs": args.max_num_seqs, "repeats": args.repeats,
               "workloads": results}
    write_results(f"cache-pressure-{jax.devices()[0].platform}", payload, table)
    print(table)


if __name__ == "__main__":
    main()
