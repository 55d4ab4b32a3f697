"""End-to-end engine performance on a DeepSeek-V4-Flash slice, beside its roofline and the
Hugging Face peer, in one run.

    python bench/e2e.py                                   # H200: 4 layers (CSA, HCA, CSA, HCA)
    python bench/e2e.py --config configs/bench/small-cpu.json --layers 2 --prefill 256 \\
        --batches 1 4 --context 512 --peer-python .venv-oracle/bin/python   # CPU check
    python bench/e2e.py --quantized --layers 34 --prefill 8192 --batches 1 16 64 \\
        --peer-python ''       # H200: the release's FP8 / FP4 formats, deepest slice that fits
    python bench/e2e.py --model v4.1 --peer-python ''   # H200: a V4.1-Flash slice (bench/lib/e2e_v41.py)

With --quantized the weights are random in the release's formats (FP8 dense projections,
FP4 routed experts, as the loader keeps them), and the run first times decode at batch
--versus-batch on a --versus-layers slice quantized and then in bf16 (one form of the
weights on the GPU at a time), the speed-up the formats buy at equal depth.

Rows: prefill of one 1k / 8k-token prompt (tokens/s, which is also its time to first token)
and steady decode at batch 1, 16, 64, 256 with a 4k context (tokens/s and the per-step
inter-token latency percentiles). The requests of a decode case share their first
context - 64 tokens through the prefix cache (prefilled once), so the case starts quickly
and each request still attends over its full context.

Rooflines, measured in the same run: a decode step must read the dense weights, the hit
experts' weights (expected number for uniform routing) and each request's cache rows (window,
selected compressed rows, the indexer's keys), counted in the bytes stored (FP8 codes, packed
FP4 and their scales when quantized); over the measured copy bandwidth. A prefill
token costs 2 FLOPs per active parameter plus attention's; over XLA's measured bf16 matmul
rate. The peer (bench/peers/hf_e2e.py) runs in its own process first, so that the two
never share the GPU's memory.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
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

from bench.lib.ceilings import DATASHEET_BF16_TFLOPS, DATASHEET_TBPS  # noqa: E402
from bench.lib.ceilings import measure as measure_ceilings  # noqa: E402
from bench.lib.decode import decode  # noqa: E402
from bench.lib.engine_loop import prefill_seconds  # noqa: E402
from bench.lib.models import V4_FLASH, engine_params, slice_config  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402
from bench.lib.rooflines import (  # noqa: E402
    decode_roofline,
    override_fp4_defaults,
    prefill_roofline,
    weight_counts,
)
from bench.lib.timing import MIN_REPEATS  # noqa: E402
from deepinfer_jax import LLM, Model  # noqa: E402
from deepinfer_jax.config.hf import read_model_config, to_hf_dict  # noqa: E402
from deepinfer_jax.config.model import ModelConfig  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402
from pallas_kernels.quantized import dequantize, is_quantized, nbytes  # noqa: E402

# --- the engine -----------------------------------------------------------------------------

def prefill(llm: LLM, length: int, rng) -> dict:
    samples = prefill_seconds(llm, length, MIN_REPEATS, rng)
    seconds = statistics.median(samples)
    return {"tokens_per_s": length / seconds, "ttft_s": seconds, "ttft_min_s": min(samples),
            "ttft_max_s": max(samples), "repeats": len(samples)}


# --- the peer -------------------------------------------------------------------------------

def run_peer(args, cfg: ModelConfig) -> dict | None:
    if not args.peer_python:
        return None
    spec = {"config": to_hf_dict(cfg), "prefill": args.prefill,
            "decode": [[b, args.context] for b in args.peer_batches],
            "new_tokens": args.peer_new_tokens, "seed": 0}
    with tempfile.TemporaryDirectory() as tmp:
        spec_file, out_file = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_file.write_text(json.dumps(spec))
        done = subprocess.run([args.peer_python, str(REPO / "bench/peers/hf_e2e.py"),
                               str(spec_file), str(out_file)], text=True, capture_output=True,
                              timeout=args.peer_timeout)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return {"error": done.stderr.strip().splitlines()[-1][:200] if done.stderr else "?"}
        return json.loads(out_file.read_text())


def table(rows: list[dict], note: str) -> str:
    lines = ["| case | engine tok/s | roofline tok/s (measured ceiling) | % of it | % of the "
             "datasheet's | TTFT s median (min-max) | ITL p50 / p90 / p99 ms | HF tok/s | "
             "engine / HF |", "|---|---:|---:|---:|---:|---|---|---:|---:|"]
    for r in rows:
        ttft = (f"{r['ttft_s']:.3f} ({r['ttft_min_s']:.3f}-{r['ttft_max_s']:.3f}, "
                f"{r['repeats']})" if "ttft_min_s" in r else "")
        sheet = r.get("datasheet_roofline_tokens_per_s")
        sheet = f"{100 * r['tokens_per_s'] / sheet:.0f}%" if sheet else ""
        itl = (" / ".join(f"{1e3 * r[f'itl_{p}_s']:.2f}" for p in ("p50", "p90", "p99"))
               if "itl_p50_s" in r else "")
        hf = r.get("hf_tokens_per_s")
        hf_cells = ("| | |" if hf is None else f"| {hf:.1f} | {r['tokens_per_s'] / hf:.1f}x |")
        lines.append(f"| {r['case']} | {r['tokens_per_s']:.0f} | "
                     f"{r['roofline_tokens_per_s']:.0f} | "
                     f"{100 * r['tokens_per_s'] / r['roofline_tokens_per_s']:.0f}% | {sheet} | "
                     f"{ttft} | "
                     f"{itl} {hf_cells}")
    return "\n".join(lines) + "\n\n" + note


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=V4_FLASH)
    ap.add_argument("--layers", type=int, default=4,
                    help="layers of the slice; 0: the deepest that fits the device (its plan)")
    ap.add_argument("--prefill", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--peer-python", default=sys.executable,
                    help="Python with torch and transformers>=5.23 ('' skips the peer)")
    ap.add_argument("--peer-batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--peer-new-tokens", type=int, default=16)
    ap.add_argument("--peer-timeout", type=int, default=420)
    ap.add_argument("--name", default=None)
    ap.add_argument("--quantized", action="store_true",
                    help="weights in the release's formats (FP8 dense, FP4 routed experts)")
    ap.add_argument("--versus-layers", type=int, default=4,
                    help="with --quantized: the slice timed in bf16 and quantized first "
                         "(0: none)")
    ap.add_argument("--versus-batch", type=int, default=16)
    ap.add_argument("--versus-only", action="store_true",
                    help="with --quantized: the quantized vs bf16 comparison alone")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--fp4-config", nargs="*", default=[], metavar="FIELD=INT",
                    help="candidate defaults timed: Fp4Config fields (pallas_kernels/"
                         "grouped_gemm/mosaic_gpu_fp4.py) set in the compiled configs")
    ap.add_argument("--token-buckets", type=int, nargs="+", default=None,
                    help="the step's token buckets (default: 16 64 256 1024 and the prefill "
                         "lengths); a deep slice compiles each, so fewer start sooner")
    ap.add_argument("--model", choices=("v4", "v4.1"), default="v4",
                    help="v4.1: a V4.1-Flash slice (--config: a V4.1 config; bench/lib/e2e_v41.py)")
    ap.add_argument("--v41-reusers", type=int, default=5,
                    help="v4.1: layers after the KV source that reuse it")
    ap.add_argument("--engram-tables", choices=("host", "device"), default="host",
                    help="v4.1: the Engram tables in host memory (the host hashes; a "
                         "synchronous loop) or on the device (the step hashes; asynchronous)")
    ap.add_argument("--engram-vocab", type=int, default=None,
                    help="v4.1: Engram hash buckets per head (default: the config's, at most "
                         "200000)")
    ap.add_argument("--parallel", default=None, metavar="AXIS=N[,...]",
                    help="the model over a device mesh (e.g. dp=8, dp=4,ep=2), rows per GPU: "
                         "bench/lib/e2e_parallel.py; --batches are then requests per GPU")
    ap.add_argument("--devices", type=int, default=None,
                    help="with --parallel: the devices its layout must span (a check)")
    ap.add_argument("--full-model", action="store_true",
                    help="the config's own layers and MTP block (not a --layers slice)")
    ap.add_argument("--cp-prefill", type=int, nargs="*", default=[],
                    help="with --parallel: prompt lengths prefilled by an engine context "
                         "parallel over every device")
    ap.add_argument("--spec-batches", type=int, nargs="*", default=[],
                    help="with --parallel: requests per GPU timed with exactly --spec-k MTP "
                         "drafts verified a step, beside plain decoding")
    ap.add_argument("--spec-k", type=int, default=3)
    ap.add_argument("--acceptance-from", type=Path, default=None,
                    help="a spec-verify result (.json): the trained tiny model's tokens per "
                         "verify step, imposed on --spec-batches' rows")
    ap.add_argument("--profile-batch", type=int, default=0,
                    help="with --parallel: requests per GPU whose decode is profiled for the "
                         "collectives' time per layer (0: none)")
    args = ap.parse_args()
    buckets = set(args.token_buckets or (16, 64, 256, 1024)) | {max(args.prefill)}
    engine_shapes = lambda: dict(  # noqa: E731
        max_num_seqs=max(args.batches), max_model_len=max(max(args.prefill), args.context) + 64,
        max_num_batched_tokens=max(args.prefill), enable_prefix_caching=True,
        token_buckets=tuple(sorted(buckets | set(args.prefill))),
        gpu_memory_utilization=args.gpu_memory_utilization)
    if args.fp4_config:
        override_fp4_defaults(dict(item.split("=") for item in args.fp4_config))
    if args.parallel:
        from bench.lib import e2e_parallel
        options = engine_shapes()
        del options["max_num_seqs"]                              # a rank's, set per case
        options["compilation_cache_dir"] = str(REPO / ".cache" / "xla-bench")
        return e2e_parallel.run(args, options)
    if args.model == "v4.1":
        from bench.lib import e2e_v41
        return e2e_v41.run(args, engine_shapes(), prefill, decode, table)
    if args.layers == 0:
        args.layers = deepest_slice(args, engine_shapes())

    cfg = slice_config(args.config, args.layers)
    peer = run_peer(args, cfg)                         # first: it frees the GPU when it exits
    print("peer:", peer, flush=True)
    ceilings = measure_ceilings(small=jax.default_backend() != "gpu")
    print(ceilings, flush=True)
    versus = (quantized_versus_bf16(args, ceilings) if args.quantized and args.versus_layers
              else None)
    if versus and args.versus_only:
        write_results(args.name or f"e2e-versus-{jax.devices()[0].platform}",
                      {"environment": environment(), "ceilings": ceilings,
                       "fp4_config": args.fp4_config, "quantized_vs_bf16": versus},
                      versus_table(versus) + (f"\n\nFP4 kernel configs with {args.fp4_config} "
                                              f"(--fp4-config)." if args.fp4_config else ""))
        return

    start = time.perf_counter()
    params = engine_params(jax.block_until_ready(random_params(
        cfg, 0, jnp.bfloat16, release_formats=args.quantized)))
    startup = {"random_weights_s": time.perf_counter() - start}
    counts = weight_counts(params, cfg)
    start = time.perf_counter()
    llm = LLM(Model(cfg, params), **engine_shapes(),
              compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
    startup["engine_s"] = time.perf_counter() - start      # the memory probe and every bucket
    print("start-up:", startup, flush=True)
    plan = llm.engine.memory_plan
    if plan is not None:
        print(plan.format(), flush=True)
    rng = np.random.default_rng(0)
    peer_rows = {r["case"]: r for r in (peer or {}).get("rows", [])}
    rows = []
    for length in args.prefill:
        row = {"case": f"prefill {length}", **prefill(llm, length, rng)}
        roof = prefill_roofline(counts, cfg, length, ceilings["matmul_tflops"])
        row |= {"roofline_tokens_per_s": roof["tokens_per_s"], "flops": roof["flops"],
                "datasheet_roofline_tokens_per_s": roof["tokens_per_s"] * DATASHEET_BF16_TFLOPS
                / ceilings["matmul_tflops"]}
        if f"prefill {length}" in peer_rows:
            row["hf_tokens_per_s"] = peer_rows[f"prefill {length}"]["tokens_per_s"]
        rows.append(row)
        print(row, flush=True)
    for batch in args.batches:
        row = {"case": f"decode b{batch} ctx {args.context}",
               **decode(llm, batch, args.context, args.steps, rng)}
        roof = decode_roofline(counts, cfg, batch, args.context, ceilings["copy_tbps"])
        row |= {"roofline_tokens_per_s": roof["tokens_per_s"],
                "bytes_per_step": roof["bytes_per_step"],
                "datasheet_roofline_tokens_per_s": roof["tokens_per_s"] * DATASHEET_TBPS
                / ceilings["copy_tbps"]}
        if "tokens_per_s" in peer_rows.get(row["case"], {}):
            row["hf_tokens_per_s"] = peer_rows[row["case"]]["tokens_per_s"]
        rows.append(row)
        print(row, flush=True)

    env = environment() | {"peer": {k: v for k, v in (peer or {}).items() if k != "rows"}}
    formats = ("the release's formats (FP8 dense projections, FP4 routed experts; "
               f"{sum(map(nbytes, jax.tree.leaves(params, is_leaf=is_quantized))) / 2**30:.1f} "
               "GiB of weights)" if args.quantized else "bf16")
    note = (f"Model: {args.config.name} cut to {args.layers} layers "
            f"({', '.join(k.name for k in cfg.layer_types)}), random weights in {formats}, "
            f"routed MoE in every layer. Ceilings measured in this run: matmul "
            f"{ceilings['matmul_tflops']:.0f} TFLOP/s, copy {ceilings['copy_tbps']:.2f} TB/s. "
            f"Peer: HF transformers {env['peer'].get('transformers', '-')} DeepseekV4ForCausalLM, "
            f"bf16, eager attention (its only one), same slice and prompt lengths; its decode "
            f"rows: prompts prefilled in chunks through its cache, then greedy steps timed.")
    text = table(rows, note)
    if plan is not None:
        text += "\n\nMemory plan of this run (LLM's, measured activations):\n\n" + plan.format()
    if versus:
        text += "\n\n" + versus_table(versus)
    print(text)
    name = args.name or f"e2e-{jax.devices()[0].platform}"
    text += (f"\n\nStart-up: random weights {startup['random_weights_s']:.0f} s, the engine "
             f"(memory probe and {len(engine_shapes()['token_buckets'])} buckets compiled) "
             f"{startup['engine_s']:.0f} s.")
    write_results(name, {"environment": env, "ceilings": ceilings, "weights": counts,
                         "startup": startup,
                         "rows": rows, "peer": peer, "quantized_vs_bf16": versus}, text)


# --- depth ------------------------------------------------------------------------------------

def deepest_slice(args, shapes: dict) -> int:
    """The most layers of args.config whose plan (weights from the parameter pytree's shapes,
    the activation estimate, the cache for the run's shapes) fits this device at
    args.gpu_memory_utilization, less one layer for the estimate's error."""
    from deepinfer_jax.config.engine import EngineConfig
    from deepinfer_jax.engine.devices import local_device_facts
    from deepinfer_jax.engine.memory_plan import config_plan

    facts = local_device_facts()
    if facts.memory_bytes is None:
        raise SystemExit("--layers 0 (the deepest slice that fits) needs a device that reports "
                         "its memory")

    def fits(layers: int) -> bool:
        cfg = slice_config(args.config, layers)
        step_cfg = EngineConfig(**shapes).resolve(cfg, facts)
        plan = config_plan(cfg, step_cfg, quantized=args.quantized,
                           device_bytes=facts.memory_bytes,
                           utilization=args.gpu_memory_utilization)
        return bool(plan.fits) and plan.pages >= step_cfg.max_num_seqs * step_cfg.max_blocks_per_seq

    low, high = 1, read_config_layers(args.config)
    while low < high:                       # the largest n with fits(n)
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    print(f"deepest slice that fits: {low} layers; running {max(1, low - 1)}", flush=True)
    return max(1, low - 1)


def read_config_layers(path: Path) -> int:
    return read_model_config(path).num_layers


# --- quantized vs bf16 at equal depth ------------------------------------------------------

def quantized_versus_bf16(args, ceilings: dict) -> dict:
    """Decode at args.versus_batch on an args.versus_layers slice, its weights in the release's
    formats and the same weights dequantized to bf16, each beside a check that the two models'
    logits agree (the FP8 codes and FP4 values times power-of-two scales are exact in bf16,
    so the weights are the same numbers; only the GEMMs' summation order differs). One form
    of the weights at a time (dequantized stack by stack, each quantized one freed after):
    an 80 GB GPU does not hold both at 4 layers."""
    cfg = slice_config(args.config, args.versus_layers)
    prompt = np.random.default_rng(1).integers(2, cfg.vocab_size, 256)
    out = {"layers": args.versus_layers, "batch": args.versus_batch, "context": args.context,
           "rows": {}}
    logits = {}

    def run(name: str, params) -> None:
        logits[name] = Model(cfg, params).logits(prompt)[0]
        counts = weight_counts(params, cfg)
        start = time.perf_counter()
        llm = LLM(Model(cfg, params), max_num_seqs=args.versus_batch,
                  max_model_len=args.context + 64, max_num_batched_tokens=1024,
                  token_buckets=(16, 64, 1024), enable_prefix_caching=True,
                  gpu_memory_utilization=args.gpu_memory_utilization,
                  compilation_cache_dir=str(REPO / ".cache" / "xla-bench"))
        started = time.perf_counter() - start      # the memory probe and three buckets compiled
        rng = np.random.default_rng(2)             # the same prompts for both forms
        row = decode(llm, args.versus_batch, args.context, args.steps, rng) | {"engine_s": started}
        roof = decode_roofline(counts, cfg, args.versus_batch, args.context, ceilings["copy_tbps"])
        row |= {"roofline_tokens_per_s": roof["tokens_per_s"],
                "bytes_per_step": roof["bytes_per_step"],
                "datasheet_roofline_tokens_per_s": roof["tokens_per_s"] * DATASHEET_TBPS
                / ceilings["copy_tbps"]}
        out["rows"][name] = row
        print(name, row, flush=True)
        del llm
        gc.collect()

    quantized = engine_params(random_params(cfg, 1, jnp.bfloat16, release_formats=True))
    run("quantized", quantized)
    run("bf16", dequantized_freeing(quantized))
    error = float(np.abs(logits["quantized"] - logits["bf16"]).max()
                  / np.abs(logits["bf16"]).max())
    out["logits_max_rel_error"] = error
    out["argmax_agreement"] = float(np.mean(logits["quantized"].argmax(-1)
                                            == logits["bf16"].argmax(-1)))
    out["speedup"] = out["rows"]["quantized"]["tokens_per_s"] / out["rows"]["bf16"]["tokens_per_s"]
    gc.collect()
    return out


def dequantized_freeing(params):
    """params with every FP8 / FP4 weight dequantized to bf16, each quantized weight's arrays
    freed as soon as its bf16 twin exists (never both forms of every weight at once)."""
    to_bf16 = jax.jit(functools.partial(dequantize, dtype=jnp.bfloat16))

    def one(w):
        if not is_quantized(w):
            return w
        twin = jax.block_until_ready(to_bf16(w))
        for leaf in jax.tree.leaves(w):
            leaf.delete()
        return twin

    return jax.tree.map(one, params, is_leaf=is_quantized)


def versus_table(versus: dict) -> str:
    lines = [f"Quantized vs bf16, {versus['layers']} layers, decode batch {versus['batch']} at a "
             f"{versus['context']}-token context (the bf16 model: the quantized one's weights "
             f"dequantized; logits max |diff| / max |logit| {versus['logits_max_rel_error']:.1e}, "
             f"argmax agreement {100 * versus['argmax_agreement']:.0f}% over 256 positions):",
             "", "| weights | tok/s | bytes / step | roofline tok/s (measured copy) | % of it | "
             f"% of the {DATASHEET_TBPS} TB/s datasheet's |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in versus["rows"].items():
        datasheet = versus["batch"] * DATASHEET_TBPS * 1e12 / r["bytes_per_step"]
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['bytes_per_step'] / 1e9:.2f} GB | "
                     f"{r['roofline_tokens_per_s']:.0f} | "
                     f"{100 * r['tokens_per_s'] / r['roofline_tokens_per_s']:.0f}% | "
                     f"{100 * r['tokens_per_s'] / datasheet:.0f}% |")
    lines.append(f"\nSpeed-up quantized / bf16: {versus['speedup']:.2f}x (asked: >= 1.6x).")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
