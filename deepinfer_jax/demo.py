"""`make demo`: start the engine on a model, generate greedily, print the tokens.

Until the project ships its trained tiny checkpoint, the embedded default is a tiny random
DeepSeek-V4 (configs/tiny/tiny-mixed.json: sliding, CSA and HCA layers, hash and routed MoE,
an MTP block), written to disk once and loaded back like any checkpoint.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from deepinfer_jax.config import ModelConfig
from deepinfer_jax.llm import LLM
from deepinfer_jax.request import SamplingParams
from deepinfer_jax.weights import random_params
from deepinfer_jax.weights.export import save_checkpoint

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny" / "tiny-mixed.json"


def default_model_dir(cache: Path = REPO / ".cache") -> Path:
    directory = cache / "demo-tiny-random"
    if not (directory / "model.safetensors").exists():
        cfg = ModelConfig.from_json_file(TINY_CONFIG)
        save_checkpoint(random_params(cfg, 0, jnp.float32), cfg, directory)
    return directory


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint directory (default: tiny random model)")
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args(argv)
    model_dir = args.model or default_model_dir()
    llm = LLM(model_dir, max_num_seqs=4, max_model_len=512, max_num_batched_tokens=64)
    cfg = llm.model.config
    print(f"model: {model_dir} ({cfg.num_layers} layers: "
          f"{', '.join(k.value for k in cfg.layer_types)})")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(2, cfg.vocab_size, size=n).tolist() for n in (48, 7, 130)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outputs):
        print(f"prompt ({len(prompt)} tokens) ... {prompt[-6:]}")
        print(f"  -> {out.token_ids}" + (f"\n     {out.text!r}" if out.text else ""))
    total = sum(len(o.token_ids) for o in outputs)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.0f} tok/s, greedy)")


if __name__ == "__main__":
    main()
