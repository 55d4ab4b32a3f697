"""How long a new process takes to start the engine: cold, and with a warm step cache.

    python bench/startup.py [--repeats 5]

Each repeat is a fresh process with the shipped model and the quick start's shapes
(QUICKSTART_SHAPES), its caches under a temporary XDG_CACHE_HOME: (1) `LLM()` ready, from the
process's start (the interpreter and imports included) and the `LLM()` call alone; (2)
`deepinfer generate` of 16 tokens, end to end (the process's wall time); (3) the cold start
(empty cache directories), once, which also fills the cache (1) and (2) read.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.lib.results import write_results  # noqa: E402

# The process's start to a ready LLM(): the interpreter's clock at start is not visible to
# the child, so the parent times the whole process and the child reports its phases.
LLM_READY = """
import json, time
start = time.perf_counter()
from deepinfer_jax import LLM
from deepinfer_jax.engine import step_cache
imported = time.perf_counter()
llm = LLM()
ready = time.perf_counter()
from deepinfer_jax import SamplingParams     # the output the CLI runs must reproduce (untimed)
[out] = llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=16, ignore_eos=True),
                     use_tqdm=False)
print(json.dumps({"import_s": imported - start, "llm_s": ready - imported,
                  "stats": vars(step_cache.stats), "text": out.outputs[0].text}))
"""


def run(args: list[str], env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    return seconds, done.stdout


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": values}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="startup-cpu")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="deepinfer-startup-") as xdg:
        env = {**os.environ, "XDG_CACHE_HOME": xdg, "PYTHONPATH": str(REPO),
               "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        python = [sys.executable, "-c", LLM_READY]
        cold_wall, out = run(python, env)
        cold = json.loads(out.strip().splitlines()[-1])
        assert cold["stats"]["traced"] > 0 and cold["stats"]["loaded"] == 0, cold
        print(f"cold: {cold_wall:.1f} s", cold, flush=True)
        ready_wall, llm_call = [], []
        for _ in range(args.repeats):
            wall, out = run(python, env)
            warm = json.loads(out.strip().splitlines()[-1])
            assert warm["stats"]["traced"] == 0 and warm["stats"]["loaded"] > 0, warm
            ready_wall.append(wall)
            llm_call.append(warm["llm_s"])
            print(f"warm LLM(): process {wall:.2f} s, LLM() call {warm['llm_s']:.2f} s",
                  flush=True)
        generate = []
        cli = [sys.executable, "-m", "deepinfer_jax.api.cli", "generate", "--prompt",
               "def fibonacci(n):", "--max-tokens", "16", "--ignore-eos"]
        for _ in range(args.repeats):
            wall, out = run(cli, env)
            generate.append(wall)
            # greedy: the warm start's tokens are the cold-compiled engine's
            assert f"(length) {cold['text']!r}" in out, (out, cold["text"])
            print(f"warm generate 16 tokens: {wall:.2f} s  {out.strip()[:80]}", flush=True)
    payload = {
        "shapes": "QUICKSTART_SHAPES", "repeats": args.repeats,
        "cold_process_s": cold_wall, "cold_llm_s": cold["llm_s"], "cold_stats": cold["stats"],
        "warm_process_to_ready_s": summary(ready_wall), "warm_llm_call_s": summary(llm_call),
        "warm_generate_16_s": summary(generate),
        "load_average": os.getloadavg(),
    }

    def row(name: str, s: dict, target: str) -> str:
        return f"| {name} | {s['median']:.2f} | {s['min']:.2f}-{s['max']:.2f} | {target} |\n"

    table = ("| start | median s | min-max s | target |\n|---|---:|---:|---|\n"
             + row("warm: a fresh process to `LLM()` ready (interpreter and imports "
                   "included)", payload["warm_process_to_ready_s"], "< 5 s")
             + row("warm: the `LLM()` call alone", payload["warm_llm_call_s"], "")
             + row("warm: `deepinfer generate` of 16 tokens, end to end",
                   payload["warm_generate_16_s"], "< 10 s")
             + f"| cold: empty caches, a fresh process to `LLM()` ready (once) | "
               f"{cold_wall:.1f} | | stated |\n"
             + f"\nEach warm figure: {args.repeats} fresh processes. Load average at the end: "
               f"{', '.join(f'{x:.1f}' for x in payload['load_average'])} (a shared machine).")
    print(write_results(args.name, payload, table).read_text())


if __name__ == "__main__":
    main()
