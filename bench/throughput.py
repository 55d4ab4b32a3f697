"""Offline throughput: the engine vs sequential Hugging Face generation, same prompts, one run.

    python bench/throughput.py [--config configs/bench/small-cpu.json] [--num-prompts 32]

Builds a random checkpoint for the config (float32), runs the prompts through the engine
(continuous batching, chunked prefill) and through HF `generate` one prompt at a time (in the
oracle environment, .venv-oracle), checks that both produce the same greedy tokens, and writes
bench/results/throughput-<device>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.results import environment, write_results  # noqa: E402
from deepinfer_jax import LLM, SamplingParams  # noqa: E402
from deepinfer_jax.config.hf import read_model_config  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402
from deepinfer_jax.weights.export import save_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs/bench/small-cpu.json")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--min-input", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--hf-python", default=str(REPO / ".venv-oracle/bin/python"))
    args = ap.parse_args()

    cfg = read_model_config(args.config)
    ckpt = REPO / ".cache" / "bench" / args.config.stem
    if not (ckpt / "model.safetensors").exists():
        save_checkpoint(random_params(cfg, 0, jnp.float32), cfg, ckpt)
    rng = np.random.default_rng(0)
    lengths = rng.integers(args.min_input, args.max_input + 1, size=args.num_prompts)
    prompts = [rng.integers(2, cfg.vocab_size, size=n).tolist() for n in lengths]

    t0 = time.perf_counter()
    llm = LLM(ckpt, max_num_seqs=args.max_num_seqs, max_model_len=1024,
              max_num_batched_tokens=256)
    startup = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    engine_s = time.perf_counter() - t0

    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "prompts.json", Path(tmp) / "hf.json"
        spec.write_text(json.dumps({"prompts": prompts, "max_tokens": args.output_len}))
        subprocess.run([args.hf_python, str(REPO / "bench/peers/hf_generate.py"), str(ckpt),
                        str(spec), str(out)], check=True)
        hf = json.loads(out.read_text())
    hf_s = sum(hf["seconds"])
    same = sum(o.token_ids == h for o, h in zip(outputs, hf["outputs"]))

    generated = args.num_prompts * args.output_len
    rows = {
        "deepinfer-jax": {"seconds": engine_s, "requests_per_s": args.num_prompts / engine_s,
                          "output_tokens_per_s": generated / engine_s},
        "HF sequential": {"seconds": hf_s, "requests_per_s": args.num_prompts / hf_s,
                          "output_tokens_per_s": generated / hf_s},
    }
    payload = {
        "environment": {**environment(), "torch": hf["torch"], "transformers": hf["transformers"]},
        "config": str(args.config.relative_to(REPO)), "num_prompts": args.num_prompts,
        "input_len_range": [args.min_input, args.max_input], "output_len": args.output_len,
        "engine_startup_s": startup, "greedy_outputs_equal_hf": f"{same}/{args.num_prompts}",
        "results": rows, "speedup": hf_s / engine_s,
    }
    device = jax.devices()[0].platform
    table = "| engine | seconds | requests/s | output tokens/s |\n|---|---:|---:|---:|\n"
    for name, r in rows.items():
        table += (f"| {name} | {r['seconds']:.2f} | {r['requests_per_s']:.2f} | "
                  f"{r['output_tokens_per_s']:.1f} |\n")
    table += (f"\n{args.num_prompts} prompts of {args.min_input}-{args.max_input} tokens, "
              f"{args.output_len} greedy tokens each, `{payload['config']}` (float32, random "
              f"weights). Speed-up {payload['speedup']:.1f}x; greedy outputs equal to HF: "
              f"{payload['greedy_outputs_equal_hf']}.")
    write_results(f"throughput-{device}", payload, table)
    print(table)


if __name__ == "__main__":
    main()
