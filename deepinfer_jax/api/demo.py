"""`make demo`: start the engine on the project's trained tiny model and complete Python.

The default model is models/deepinfer-tiny-v4 (a small DeepSeek-V4 trained on the Python
standard library; see its README). Any DeepSeek-V4 checkpoint directory works with --model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from deepinfer_jax.api.llm import DEFAULT_MODEL, LLM
from deepinfer_jax.config.engine import QUICKSTART_SHAPES
from deepinfer_jax.host.request import SamplingParams

# No trailing newline: the tokenizer merges a newline with the next line's indentation, so a
# prompt that ends in "\n" would force an unindented next line.
PROMPTS = ["import os\n\n\ndef list_python_files(directory):",
           "class Stack:\n    def __init__(self):",
           'def is_prime(n):\n    """Return True if n is a prime number."""']


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    llm = LLM(args.model, **QUICKSTART_SHAPES)      # the quick start's and the CLI's shapes
    cfg = llm.model.config
    print(f"model: {args.model} ({cfg.num_layers} layers: "
          f"{', '.join(k.value for k in cfg.layer_types)})")
    start = time.perf_counter()
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=args.max_tokens))
    elapsed = time.perf_counter() - start
    for prompt, out in zip(PROMPTS, outputs):
        print("-" * 72)
        print(prompt + (out.text if out.text is not None else str(out.token_ids)))
    total = sum(len(o.token_ids) for o in outputs)
    print("-" * 72)
    print(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.0f} tok/s, greedy)")


if __name__ == "__main__":
    main()
