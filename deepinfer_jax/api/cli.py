"""The `deepinfer` command: `generate` a few prompts, or `bench` the engine's throughput."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from deepinfer_jax.config.engine import QUICKSTART_SHAPES


def _engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="checkpoint directory (default: models/deepinfer-tiny-v4)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the checkpoint's")
    # the quick start's shapes (one compile serves the CLI, LLM() and `make demo`)
    for name, value in QUICKSTART_SHAPES.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    ap.add_argument("--num-pages", type=int)


def _make_llm(args):
    from deepinfer_jax.api.llm import LLM

    return LLM(args.model, dtype=args.dtype,
               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
               max_num_batched_tokens=args.max_num_batched_tokens, num_pages=args.num_pages)


def generate(args) -> int:
    from deepinfer_jax.host.request import SamplingParams

    prompts: list = list(args.prompt or [])
    prompts += [[int(t) for t in ids.split(",")] for ids in args.prompt_ids or []]
    if not prompts:
        print("give at least one --prompt or --prompt-ids", file=sys.stderr)
        return 2
    llm = _make_llm(args)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    for out in llm.generate(prompts, params):
        if out.error is not None:
            print(f"[{out.request_id}] error: {out.error}")
            continue
        shown = repr(out.text) if out.text is not None else out.token_ids
        print(f"[{out.request_id}] ({out.finish_reason.value}) {shown}")
    return 0


def bench(args) -> int:
    from deepinfer_jax.host.request import SamplingParams

    llm = _make_llm(args)
    rng = np.random.default_rng(args.seed)
    vocab = llm.model.config.vocab_size
    prompts = [rng.integers(2, vocab, size=args.input_len).tolist() for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)   # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    result = {"requests": len(prompts), "input_len": args.input_len, "output_len": args.output_len,
              "seconds": round(elapsed, 3), "requests_per_s": round(len(prompts) / elapsed, 3),
              "output_tokens_per_s": round(generated / elapsed, 1),
              "total_tokens_per_s": round((generated + args.input_len * len(prompts)) / elapsed, 1)}
    print(json.dumps(result, indent=2))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    ap.add_argument("--debug", action="store_true",
                    help="show the Python traceback of an error (default: one line)")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions for prompts")
    _engine_args(g)
    g.add_argument("--prompt", action="append", help="a text prompt (needs tokenizer.json)")
    g.add_argument("--prompt-ids", action="append", help="comma-separated token ids")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=generate)
    b = sub.add_parser("bench", help="offline throughput on random prompts")
    _engine_args(b)
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=32)
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=bench)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv        # anywhere, before or after the command
    args = ap.parse_args([a for a in argv if a != "--debug"])
    if debug:
        return args.func(args)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("deepinfer: interrupted", file=sys.stderr)
        return 130
    except Exception as e:       # a bad checkpoint, config, tokenizer or option: one line
        print(f"deepinfer: error: {_one_line(e)}", file=sys.stderr)
        return 1


def _one_line(e: Exception) -> str:
    """The error's type and message on one line (multi-line messages, such as a checkpoint's
    list of offending tensors, joined with "; ")."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {'; '.join(lines) or repr(e)} (--debug for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
