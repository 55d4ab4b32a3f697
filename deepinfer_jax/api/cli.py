"""The `deepinfer` command: `generate` a few prompts, `serve` the OpenAI API over HTTP, `bench`
the engine's throughput, `plan` a model's device memory from its configuration, `convert` a
checkpoint once into a store that restores straight into a device mesh, or `eval` lm-eval tasks
with a replayable run manifest (api/eval_cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from deepinfer_jax.api import eval_cli, serve_cli
from deepinfer_jax.api.cli_llm import make_llm as _make_llm
from deepinfer_jax.api.cli_llm import model_config_path as _model_config_path
from deepinfer_jax.config.engine import QUICKSTART_SHAPES


def _engine_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="checkpoint directory (default: models/deepinfer-tiny-v4)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the checkpoint's")
    # the quick start's shapes (one compile serves the CLI, LLM() and `make demo`)
    for name, value in QUICKSTART_SHAPES.items():
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=value)
    ap.add_argument("--token-buckets", type=int, nargs="+", metavar="N",
                    help="the tokens-per-step shapes compiled (default: powers of two from 16 "
                         "up to --max-num-batched-tokens)")
    ap.add_argument("--num-pages", type=int)
    ap.add_argument("--gpu-memory-utilization", type=float,
                    help="share of a device's memory for weights, activations, cache (0.9)")
    ap.add_argument("--device-memory-gib", type=float,
                    help="a device's memory (default: what the device reports)")
    ap.add_argument("--enable-prefix-caching", action="store_true")
    ap.add_argument("--parallel", type=_mesh_sizes, metavar="AXIS=N,...",
                    help="the device mesh, e.g. ep=8, dp=2,ep=4 or ep=4,tp=2 (axes dp, cp, ep, "
                         "tp)")
    ap.add_argument("--coordinator-address", metavar="HOST:PORT",
                    help="one engine over several processes (multi-controller JAX): process "
                         "0's address; every process runs the same command with its own "
                         "--process-id")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--weights", choices=["quantized", "bf16"], default="quantized",
                    help="keep a checkpoint's FP8/FP4 weights quantized (default) or "
                         "dequantize them at load")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                    help="dummy: random weights from the model's config alone (MODEL: a "
                         "directory with config.json, a config.json, or a project config "
                         "such as deepseek-v4-flash); no checkpoint is read")
    ap.add_argument("--dummy-layers", type=int, metavar="N",
                    help="with --load-format dummy: the config cut to N layers (CSA and HCA "
                         "alternating, routed MoE in each, no MTP), as bench/e2e.py's slices")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="a request's numbers never depend on its batch")
    ap.add_argument("--speculative-tokens", type=int, metavar="K",
                    help="MTP speculative decoding with up to K drafts a step")
    ap.add_argument("--speculative-token-map", metavar="PATH",
                    help="with --speculative-tokens: draft only these token ids (a JSON list "
                         "or .npy; tools/draft_token_map.py writes one)")


def _sampling_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=0, help="0: off")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--seed", type=int, help="a request's random stream (default: drawn)")
    ap.add_argument("--stop", action="append", help="a stop string (repeatable)")
    ap.add_argument("--n", type=int, default=1, help="completions per prompt")
    ap.add_argument("--logprobs", type=int, help="top logprobs to print per token")
    constraint = ap.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", help="a JSON schema, inline or @file")
    constraint.add_argument("--regex")
    constraint.add_argument("--grammar", help="a Lark / GBNF grammar, inline or @file")


def _mesh_sizes(text: str) -> dict[str, int]:
    """"ep=4,tp=2" -> {"ep": 4, "tp": 2} (the axes are checked by EngineConfig)."""
    sizes = {}
    for part in text.split(","):
        axis, _, size = part.partition("=")
        if not size.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected AXIS=N[,AXIS=N...], got {text!r}")
        sizes[axis.strip()] = int(size)
    return sizes


def _text_or_file(value: str | None) -> str | None:
    if value is not None and value.startswith("@"):
        with open(value[1:]) as f:
            return f.read()
    return value


def _sampling_params(args):
    from deepinfer_jax.host.request import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=args.stop or [],
        n=args.n, logprobs=args.logprobs, json_schema=_text_or_file(args.json_schema),
        regex=args.regex, grammar=_text_or_file(args.grammar))


def generate(args) -> int:
    prompts: list = list(args.prompt or [])
    prompts += [[int(t) for t in ids.split(",")] for ids in args.prompt_ids or []]
    if not prompts:
        print("give at least one --prompt or --prompt-ids", file=sys.stderr)
        return 2
    params = _sampling_params(args)
    llm = _make_llm(args)
    failed = 0
    for out in llm.generate(prompts, params):
        if out.error is not None:       # that request alone: the others are still printed
            print(f"[{out.request_id}] error: {_one_line(out.error, hint=False)}",
                  file=sys.stderr)
            failed += 1
            continue
        for completion in out.outputs:
            shown = repr(completion.text) if completion.text is not None else completion.token_ids
            tag = out.request_id if len(out.outputs) == 1 else f"{out.request_id}.{completion.index}"
            print(f"[{tag}] ({completion.finish_reason.value}) {shown}")
            for entry in completion.logprobs or []:
                print("    " + ", ".join(f"{lp.decoded_token!r}: {lp.logprob:.3f}"
                                         for lp in entry.values()))
    return 1 if failed else 0


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


def plan(args) -> int:
    """Print the memory plan from the model's config alone: no weights read, nothing
    compiled (engine/memory_plan.py `config_plan`)."""
    from deepinfer_jax.config import options
    from deepinfer_jax.config.engine import EngineConfig
    from deepinfer_jax.config.errors import InsufficientMemoryError
    from deepinfer_jax.config.hf import read_model_config
    from deepinfer_jax.config.memory import plan_pool
    from deepinfer_jax.engine.memory_plan import config_plan

    path = _model_config_path(args.model)
    cfg = read_model_config(path)              # DeepSeek-V4 or V4.1
    engine = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          max_num_batched_tokens=args.max_num_batched_tokens or max(
                              256, args.max_num_seqs), engram_tables=args.engram_tables)
    step_cfg = engine.resolve(cfg)
    quantized = (args.weights or ("quantized" if cfg.quantization else "bf16")) == "quantized"
    device_bytes = options.device_memory(args.device_memory_gib, options.CPU)
    devices = args.devices
    if args.parallel:
        from deepinfer_jax.config.parallel import ParallelConfig

        parallel = ParallelConfig.from_options(args.parallel)
        parallel.check(cfg, parallel.size)
        devices = parallel.expert_ranks
        print(f"parallel         {parallel.describe()} (routed experts split {devices} ways)")
    result = config_plan(cfg, step_cfg, devices=devices, quantized=quantized,
                         device_bytes=device_bytes,
                         utilization=options.memory_utilization(args.gpu_memory_utilization))
    print(f"model            {path}")
    print(f"shapes           max_num_seqs {step_cfg.max_num_seqs}, max_model_len "
          f"{step_cfg.max_model_len}, token buckets {list(step_cfg.token_buckets)}")
    print(result.format())
    if result.fits is False:
        try:
            plan_pool(result)
        except InsufficientMemoryError as e:
            print(f"does not fit: {e}")
        return 1
    return 0


def convert(args) -> int:
    """Read a safetensors checkpoint once and write it as a store (weights/orbax_store.py)."""
    from deepinfer_jax.api.model import convert as convert_checkpoint

    start = time.perf_counter()
    out = convert_checkpoint(args.checkpoint, args.out, dtype=args.dtype, weights=args.weights)
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s: load it as `deepinfer "
          f"generate --model {out}` or LLM({str(out)!r}, parallel=...)")
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
    _sampling_args(g)
    g.set_defaults(func=generate)
    serve_cli.add_parser(sub, _engine_args)
    b = sub.add_parser("bench", help="offline throughput on random prompts")
    _engine_args(b)
    b.add_argument("--num-prompts", type=int, default=32)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=32)
    b.add_argument("--seed", type=int, default=0)
    b.set_defaults(func=bench)
    p = sub.add_parser("plan", help="device memory plan from a model's config (no weights, "
                                    "no compile)")
    p.add_argument("model", help="model directory, config.json, or a project config "
                                 "(e.g. deepseek-v4-flash)")
    p.add_argument("--devices", type=int, default=1,
                   help="devices: routed experts split N ways, the rest replicated")
    p.add_argument("--parallel", type=_mesh_sizes, metavar="AXIS=N,...",
                   help="the mesh the engine would run (e.g. dp=8): its routed experts are "
                        "split over dp x cp x ep devices (overrides --devices)")
    p.add_argument("--device-memory-gib", type=float, help="one device's memory (default: "
                   "DEEPINFER_DEVICE_MEMORY_GIB, else the plan says what is needed)")
    p.add_argument("--gpu-memory-utilization", type=float, help="default 0.9")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, help="default: max(256, max-num-seqs)")
    p.add_argument("--weights", choices=["quantized", "bf16"],
                   help="default: quantized for an FP8 checkpoint's config, else bf16")
    p.add_argument("--engram-tables", choices=["host", "device"],
                   help="DeepSeek-V4.1's Engram tables in host memory (default) or on the device")
    p.set_defaults(func=plan)
    c = sub.add_parser("convert", help="write a checkpoint once as an orbax store that "
                                       "restores straight into a device mesh")
    c.add_argument("checkpoint", help="checkpoint directory (config.json + safetensors)")
    c.add_argument("out", help="the store's directory (new or empty)")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the checkpoint's")
    c.add_argument("--weights", choices=["quantized", "bf16"], default="quantized",
                   help="keep FP8/FP4 weights quantized (default) or store them dequantized")
    c.set_defaults(func=convert)
    eval_cli.add_parser(sub)
    sub.choices["eval"].set_defaults(func=eval_cli.run)
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


def _one_line(e: Exception, hint: bool = True) -> str:
    """The error's type and message on one line (multi-line messages, such as a checkpoint's
    list of offending tensors, joined with "; ")."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return (f"{type(e).__name__}: {'; '.join(lines) or repr(e)}"
            + (" (--debug for the traceback)" if hint else ""))


if __name__ == "__main__":
    sys.exit(main())
