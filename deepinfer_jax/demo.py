"""`make demo`: load a model, generate greedily, print the tokens.

Until the project ships its trained tiny checkpoint, the embedded default is a tiny random
DeepSeek-V4 (configs/tiny/tiny-mixed.json: sliding, CSA and HCA layers, hash and routed MoE,
an MTP block), written to disk and loaded back like any checkpoint.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np

import deepinfer_jax
from deepinfer_jax.config import ModelConfig
from deepinfer_jax.weights import random_params
from deepinfer_jax.weights.export import save_checkpoint

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "tiny" / "tiny-mixed.json"


def default_model_dir(cache: Path) -> Path:
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
    model_dir = args.model or default_model_dir(REPO / ".cache")
    model = deepinfer_jax.load(model_dir)
    cfg = model.config
    prompt = np.random.default_rng(0).integers(2, cfg.vocab_size, size=48).tolist()
    print(f"model: {model_dir} ({cfg.num_layers} layers: "
          f"{', '.join(k.value for k in cfg.layer_types)})")
    print(f"prompt ({len(prompt)} tokens): {prompt}")
    tokens, start = list(prompt), time.perf_counter()
    for _ in range(args.max_tokens):
        tokens.append(int(model.logits(tokens)[0, -1].argmax()))
    print(f"greedy continuation ({args.max_tokens} tokens, {time.perf_counter() - start:.1f} s): "
          f"{tokens[len(prompt):]}")


if __name__ == "__main__":
    main()
