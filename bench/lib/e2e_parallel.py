"""bench/e2e.py --parallel: the model over a device mesh, per GPU, beside its per-device
roofline (issue 34's run: V4-Flash's 43 layers on 8 H200s with DP attention and EP).

    python bench/e2e.py --devices 8 --parallel dp=8 --full-model --quantized --prefill 8192 \\
        --cp-prefill 65536 --batches 8 64 256 1024 --spec-batches 1 64 \\
        --acceptance-from bench/results/spec-verify-cpu.json --peer-python ''   # 8 GPUs
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/e2e.py --parallel dp=4,ep=2 \\
        --config configs/tiny/tiny-mixed.json --full-model --prefill 128 --cp-prefill 256 \\
        --batches 2 --context 192 --token-buckets 16 128 --peer-python ''   # CPU: 8 host devices

Rows, all per GPU (the mesh's devices):
* check: a 2-layer slice of the same config on the same layout, greedy, against the model's
  plain forward (api/model.py `Model.logits`, no pages, no mesh) on the same weights: the
  share of generated tokens that are the forward's argmax (a bf16 near-tie may flip one).
* prefill L: one L-token prompt per data-parallel rank at once (the ranks prefill side by
  side); tokens/s per GPU = ranks x L / time / devices, TTFT median (min-max) of 5.
* cp prefill L (--cp-prefill): a second engine, context parallel over every device (dp 1),
  one prompt: tokens/s per GPU = L / time / devices.
* decode b: b requests per GPU (b x devices in all, an equal share per rank) at --context
  tokens, sharing a prefix each rank's cache holds (bench/lib/decode.py's case, per rank).
* spec b (--spec-batches, --spec-k): a second engine with the MTP layer verifying exactly k
  drafts a request every step, beside the plain engine at the same batch (own prompts); the
  speed-up implied by the trained tiny model's tokens per verify step (--acceptance-from, a
  spec-verify result): random weights accept nothing, so acceptance is imposed, not measured.
* collectives: the decode step's all-to-all / all-gather / reduce-scatter kernels per layer
  on the first GPU's timeline of a profile at --profile-batch (a CPU trace has none: no row).

Rooflines are a device's: its share of the stored weights (the parallel/mesh.py placement:
routed experts split over dp x cp x ep, the rest replicated or split over tp as placed),
the experts of its share that the step's tokens hit (every rank's tokens reach every
device's experts; uniform routing), and its rank's cache rows; over the copy ceiling
measured on one device. Prefill: the slice's FLOPs (bench/lib/rooflines.py) over the
devices, an even split, over the matmul ceiling measured on one device.
"""

from __future__ import annotations

import functools
import gc
import re
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.lib import peer_figures
from bench.lib.ceilings import DATASHEET_BF16_TFLOPS, DATASHEET_TBPS
from bench.lib.ceilings import measure as measure_ceilings
from bench.lib.decode import decode_timed, start_shared_prefix_batch
from bench.lib.device_time import busy_and_span_of, device_events, kernel_totals, trace_events
from bench.lib.engine_loop import abort_all
from bench.lib.models import engine_params
from bench.lib.results import environment, write_results
from bench.lib.rooflines import mesh_decode_roofline, mesh_weight_counts, prefill_roofline
from bench.lib.timing import MIN_REPEATS
from bench.spec_verify import acceptance_from, forced, pow2_at_least, step_ms
from deepinfer_jax import LLM, Model, SamplingParams
from deepinfer_jax.config.hf import read_model_config
from deepinfer_jax.config.model import ModelConfig
from deepinfer_jax.config.parallel import ParallelConfig
from deepinfer_jax.config.slice import slice_config
from deepinfer_jax.parallel.mesh import make_mesh, param_shardings
from deepinfer_jax.weights import random_params

REPO = Path(__file__).resolve().parents[2]
CHECK_LAYERS, CHECK_TOKENS = 2, 16
# the collectives' kernel names in a GPU profile (NCCL's, XLA's own)
COLLECTIVE = re.compile(r"nccl|all[-_]?to[-_]?all|all[-_]?gather|reduce[-_]?scatter|all[-_]?reduce"
                        r"|collective[-_]?permute", re.IGNORECASE)


def parse_layout(text: str) -> dict:
    """"dp=8,ep=1" -> {"dp": 8, "ep": 1} (ParallelConfig checks the names)."""
    try:
        return {axis.strip(): int(n) for axis, n in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise SystemExit(f"--parallel {text!r}: expected axis=N[,axis=N...], e.g. dp=8") from None


def model_config(args) -> ModelConfig:
    """--full-model: the config as released (every layer, its MTP block; unquantized without
    --quantized); else the --layers slice, with an MTP layer when --spec-batches asks for one."""
    if args.full_model:
        cfg = read_model_config(args.config)
        return cfg if args.quantized else cfg.replace(quantization=None)
    cfg = slice_config(read_model_config(args.config), args.layers)
    return cfg.replace(num_mtp_layers=1) if args.spec_batches else cfg


def draw_params(cfg: ModelConfig, parallel: ParallelConfig | None, quantized: bool):
    """Random weights, drawn straight into the mesh of `parallel` (each device its own
    shards: the full model is larger than one GPU) or, for None, on the default device."""
    mesh = None if parallel is None else make_mesh(parallel)
    shardings = None if mesh is None else functools.partial(param_shardings, mesh=mesh)
    return engine_params(jax.block_until_ready(random_params(
        cfg, 0, jnp.bfloat16, release_formats=quantized, shardings=shardings)))


def run(args, engine_options: dict) -> None:
    """args: e2e.py's; engine_options: LLM's shape options but max_num_seqs (set here per
    rank)."""
    layout = parse_layout(args.parallel)
    parallel = ParallelConfig.from_options(layout)
    devices = parallel.size
    if args.devices is not None and args.devices != devices:
        raise SystemExit(f"--parallel {args.parallel} spans {devices} devices, not --devices "
                         f"{args.devices}")
    if len(jax.devices()) < devices:
        raise SystemExit(f"--parallel {args.parallel} spans {devices} devices; "
                         f"{len(jax.devices())} present")
    cfg = model_config(args)
    params = draw_params(cfg, parallel, args.quantized)
    ceilings = measure_ceilings(small=jax.default_backend() != "gpu")
    print(ceilings, flush=True)
    rows = [correctness_check(args, cfg, layout, engine_options)]
    print(rows[-1], flush=True)
    rank_batches = {b: b * devices // parallel.dp for b in args.batches}
    if any(b * devices % parallel.dp for b in args.batches):
        raise SystemExit(f"--batches: each b x {devices} devices must split evenly over "
                         f"dp={parallel.dp} ranks")
    start = time.perf_counter()
    llm = LLM(Model(cfg, params), parallel=layout, max_num_seqs=max(rank_batches.values()),
              **engine_options)
    startup = {"engine_s": time.perf_counter() - start}
    counts = mesh_weight_counts(llm.engine.params, cfg, parallel.expert_ranks)
    print("start-up:", startup, "weights per device:", counts, flush=True)
    rng = np.random.default_rng(0)
    for length in args.prefill:
        rows.append(prefill_row(llm, f"prefill {length} x {parallel.dp} ranks", length,
                                parallel.dp, devices, counts, cfg, ceilings, rng))
    for b in args.batches:
        rows.append(decode_row(llm, b, rank_batches[b], parallel, counts, cfg, args, ceilings,
                               rng))
    collectives = None
    if args.profile_batch:
        collectives = profile_collectives(llm, args, rank_batches, parallel, cfg, rng)
    plain_ms = {b: step_ms(llm, b * devices, args.context, args.steps, rng)
                for b in args.spec_batches}
    del llm
    gc.collect()
    rows += speculative_rows(args, cfg, params, layout, engine_options, plain_ms, parallel, rng)
    if args.cp_prefill:
        rows += cp_prefill_rows(args, cfg, params, devices, engine_options, counts, ceilings, rng)
    payload = {"environment": environment(), "parallel": layout, "devices": devices,
               "ceilings": ceilings, "weights_per_device": counts, "startup": startup,
               "rows": rows, "collectives": collectives}
    name = args.name or f"e2e-parallel-{devices}x-{jax.devices()[0].platform}"
    write_results(name, payload, tables(payload, args, cfg))


# --- rows -------------------------------------------------------------------------------------

def correctness_check(args, cfg: ModelConfig, layout: dict, engine_options: dict) -> dict:
    """A CHECK_LAYERS slice on the same layout: greedy tokens of one prompt per rank against
    the plain forward's argmax over the same sequence."""
    small = slice_config(cfg, CHECK_LAYERS)
    params = draw_params(small, None, args.quantized)             # on one device
    ranks = ParallelConfig.from_options(layout).dp
    options = engine_options | {"max_model_len": 256, "max_num_batched_tokens": 256,
                                "token_buckets": (16, 256), "enable_prefix_caching": False}
    llm = LLM(Model(small, params), parallel=layout, max_num_seqs=ranks, **options)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, small.vocab_size, 96).tolist() for _ in range(ranks)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=CHECK_TOKENS, temperature=0.0,
                                                ignore_eos=True), use_tqdm=False)
    del llm
    gc.collect()
    reference = Model(small, params)
    agree = total = 0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        logits = reference.logits(prompt + tokens)[0]
        expected = logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].argmax(-1)
        agree += int(np.sum(expected == np.asarray(tokens)))
        total += len(tokens)
    if agree < 0.9 * total:
        raise SystemExit(f"check: the mesh engine's greedy tokens match the plain forward's "
                         f"argmax at {agree} of {total} positions")
    return {"case": f"check ({CHECK_LAYERS} layers, {ranks} prompts)", "agree": agree,
            "tokens": total}


def prefill_row(llm: LLM, case: str, length: int, prompts: int, devices: int, counts: dict,
                cfg: ModelConfig, ceilings: dict, rng) -> dict:
    """`prompts` fresh prompts of `length` tokens at once (one per data-parallel rank), to
    their first tokens; a warm-up first, then MIN_REPEATS timed."""
    vocab, one = cfg.vocab_size, SamplingParams(max_tokens=1, ignore_eos=True)

    def batch():
        return [rng.integers(2, vocab, length).tolist() for _ in range(prompts)]
    llm.generate(batch(), one, use_tqdm=False)
    samples = []
    for _ in range(MIN_REPEATS):
        ps = batch()
        start = time.perf_counter()
        llm.generate(ps, one, use_tqdm=False)
        samples.append(time.perf_counter() - start)
    seconds = statistics.median(samples)
    roof = prefill_roofline(counts, cfg, length, ceilings["matmul_tflops"])
    per_gpu = prompts * length / seconds / devices
    # the roofline of one prompt on one device, times the prompts, over the devices
    roof_per_gpu = roof["tokens_per_s"] * prompts / devices
    row = {"case": case, "tokens_per_s_per_gpu": per_gpu, "ttft_s": seconds,
           "ttft_min_s": min(samples), "ttft_max_s": max(samples), "repeats": len(samples),
           "roofline_tokens_per_s_per_gpu": roof_per_gpu,
           "datasheet_roofline_tokens_per_s_per_gpu":
               roof_per_gpu * DATASHEET_BF16_TFLOPS / ceilings["matmul_tflops"]}
    print(row, flush=True)
    return row


def decode_row(llm: LLM, per_gpu: int, rank_batch: int, parallel: ParallelConfig, counts: dict,
               cfg: ModelConfig, args, ceilings: dict, rng) -> dict:
    start_shared_prefix_batch(llm, rank_batch * parallel.dp, args.context, rng, "d",
                              first=parallel.dp)
    timed = decode_timed(llm, rank_batch * parallel.dp, args.steps)
    roof = mesh_decode_roofline(counts, cfg, rank_batch, rank_batch * parallel.dp,
                                args.context, ceilings["copy_tbps"])
    devices = parallel.size
    row = {"case": f"decode {per_gpu}/GPU ctx {args.context}", "per_gpu": per_gpu,
           "rank_batch": rank_batch, "bytes_per_step_per_device": roof["bytes_per_step"],
           "tokens_per_s_per_gpu": timed["tokens_per_s"] / devices,
           "itl_p50_s": timed["itl_p50_s"], "itl_p90_s": timed["itl_p90_s"],
           "itl_p99_s": timed["itl_p99_s"],
           # a device's step reads its bytes in roof's time, for every rank's tokens
           "roofline_tokens_per_s_per_gpu": rank_batch * parallel.dp / devices
           / roof["seconds"],
           "datasheet_roofline_tokens_per_s_per_gpu": rank_batch * parallel.dp / devices
           / (roof["bytes_per_step"] / (DATASHEET_TBPS * 1e12))}
    print(row, flush=True)
    return row


def profile_collectives(llm: LLM, args, rank_batches: dict, parallel: ParallelConfig,
                        cfg: ModelConfig, rng) -> dict | None:
    """The collectives' kernels on the first GPU's timeline per decode step and per layer, at
    --profile-batch requests per GPU; None where the trace has no GPU timeline (a CPU run)."""
    rank_batch = args.profile_batch * parallel.size // parallel.dp
    start_shared_prefix_batch(llm, rank_batch * parallel.dp, args.context, rng, "p",
                              first=parallel.dp)
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(args.steps):
                llm.engine.step()
            # the launched steps end inside the trace (as bench/lib/decode.py traced_decode)
            llm.engine.set_launch_thread(llm.engine.host.launch_thread)
            jax.block_until_ready(llm.engine.state)
        events = trace_events(Path(tmp))
    abort_all(llm.engine)
    gpus = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M"
            and e.get("name") == "process_name" and "GPU" in e["args"]["name"]}
    if not gpus:
        print("profile: no GPU timeline in the trace", flush=True)
        return None
    first = min(gpus, key=gpus.get)
    mine = [e for e in device_events(events) if e["pid"] == first]
    totals = kernel_totals(mine, args.steps)
    kernels = sorted(((n, ms, c) for n, (ms, c) in totals.items() if COLLECTIVE.search(n)),
                     key=lambda t: -t[1])
    total = sum(ms for _, ms, _ in kernels)
    return {"per_gpu": args.profile_batch, "timeline": gpus[first], "ms_per_step": total,
            "ms_per_layer": total / cfg.num_layers,
            "kernels": [{"name": n, "ms_per_step": ms, "launches": c} for n, ms, c in kernels],
            "device_busy_union_ms_per_step": busy_and_span_of(mine, args.steps)[0]}


def speculative_rows(args, cfg, params, layout, engine_options, plain_ms: dict,
                     parallel: ParallelConfig, rng) -> list[dict]:
    """Per --spec-batches b (per GPU): the engine verifying exactly --spec-k drafts a request
    every step vs the plain engine at the same batch (plain_ms, spec_verify.step_ms's)."""
    if not args.spec_batches:
        return []
    if not cfg.num_mtp_layers or not params.mtp:
        raise SystemExit("--spec-batches needs the MTP layer: --full-model keeps the config's")
    if args.acceptance_from is None:
        raise SystemExit("--spec-batches needs --acceptance-from (a spec-verify result file)")
    k = args.spec_k
    tiny = acceptance_from(args.acceptance_from, [k])[k]["tokens_per_verify_step"]
    totals = {b: b * parallel.size for b in args.spec_batches}
    rank_max = max(totals.values()) // parallel.dp
    budget = max(engine_options["max_num_batched_tokens"], rank_max * (k + 1))
    # only the buckets its steps use (prefill chunks, each batch's verify step): a deep
    # model compiles each for minutes
    buckets = {16, budget} | {max(16, pow2_at_least(total // parallel.dp * (k + 1)))
                              for total in totals.values()}
    llm = LLM(Model(cfg, params), parallel=layout, max_num_seqs=rank_max,
              speculative_config=forced(k, rank_max),
              **(engine_options | {"max_num_batched_tokens": budget,
                                   "token_buckets": tuple(sorted(buckets))}))
    rows = []
    for b in args.spec_batches:
        verify = step_ms(llm, totals[b], args.context, args.steps, rng)
        plain = plain_ms[b]
        rows.append({"case": f"spec k={k} {b}/GPU ctx {args.context}", "per_gpu": b,
                     "plain_ms": plain["ms"], "plain_ms_min": plain["ms_min"],
                     "plain_ms_max": plain["ms_max"], "verify_ms": verify["ms"],
                     "verify_ms_min": verify["ms_min"], "verify_ms_max": verify["ms_max"],
                     "repeats": verify["repeats"], "tiny_tokens_per_verify_step": tiny,
                     "implied_speedup": tiny * plain["ms"] / verify["ms"]})
        print(rows[-1], flush=True)
    del llm
    gc.collect()
    return rows


def cp_prefill_rows(args, cfg, params, devices: int, engine_options: dict, counts: dict,
                    ceilings: dict, rng) -> list[dict]:
    """One prompt per --cp-prefill length on an engine context parallel over every device."""
    longest = max(args.cp_prefill)
    options = engine_options | {"max_model_len": longest + 64, "max_num_batched_tokens": longest,
                                "token_buckets": (16, longest), "enable_prefix_caching": False}
    llm = LLM(Model(cfg, params), parallel={"cp": devices}, max_num_seqs=1, **options)
    rows = [prefill_row(llm, f"cp prefill {length} (cp={devices})", length, 1, devices, counts,
                        cfg, ceilings, rng) for length in args.cp_prefill]
    del llm
    gc.collect()
    return rows


# --- the tables -------------------------------------------------------------------------------

def tables(payload: dict, args, cfg: ModelConfig) -> str:
    ceilings, rows = payload["ceilings"], payload["rows"]
    check = rows[0]
    lines = [f"Layout {args.parallel} over {payload['devices']} devices; model "
             f"{args.config.name}, {cfg.num_layers} layers"
             f"{' + MTP' if cfg.num_mtp_layers else ''}, random weights "
             f"{'in the release formats' if args.quantized else 'bf16'}. Per GPU throughout; "
             f"ceilings measured on one device: matmul {ceilings['matmul_tflops']:.0f} TFLOP/s, "
             f"copy {ceilings['copy_tbps']:.2f} TB/s.", "",
             f"Check: {check['case']}: {check['agree']} of {check['tokens']} greedy tokens are "
             f"the plain forward's argmax.", "",
             "| case | tok/s per GPU | roofline per GPU (measured ceiling) | % of it | % of "
             "the datasheet's | TTFT s median (min-max, n) | ITL p50 / p90 / p99 ms |",
             "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if "tokens_per_s_per_gpu" not in r:
            continue
        roof, sheet = r["roofline_tokens_per_s_per_gpu"], r["datasheet_roofline_tokens_per_s_per_gpu"]
        ttft = (f"{r['ttft_s']:.3f} ({r['ttft_min_s']:.3f}-{r['ttft_max_s']:.3f}, "
                f"{r['repeats']})" if "ttft_s" in r else "")
        itl = (" / ".join(f"{1e3 * r[f'itl_{p}_s']:.2f}" for p in ("p50", "p90", "p99"))
               if "itl_p50_s" in r else "")
        lines.append(f"| {r['case']} | {r['tokens_per_s_per_gpu']:.0f} | {roof:.0f} | "
                     f"{100 * r['tokens_per_s_per_gpu'] / roof:.0f}% | "
                     f"{100 * r['tokens_per_s_per_gpu'] / sheet:.0f}% | {ttft} | {itl} |")
    lines += ["", *peer_figures.table()]
    spec = [r for r in rows if "implied_speedup" in r]
    if spec:
        lines += ["", "Speculation (MTP, exactly k drafts verified a step; acceptance imposed "
                  "from the trained tiny model's tokens per verify step, "
                  f"{args.acceptance_from}):", "",
                  "| case | plain ms/step (min-max) | verify ms/step (min-max) | tiny tokens / "
                  "verify step | implied speed-up |", "|---|---|---|---:|---:|"]
        for r in spec:
            lines.append(f"| {r['case']} | {r['plain_ms']:.2f} ({r['plain_ms_min']:.2f}-"
                         f"{r['plain_ms_max']:.2f}) | {r['verify_ms']:.2f} ({r['verify_ms_min']:.2f}"
                         f"-{r['verify_ms_max']:.2f}) | {r['tiny_tokens_per_verify_step']:.2f} | "
                         f"{r['implied_speedup']:.2f}x |")
    collectives = payload["collectives"]
    if collectives:
        lines += ["", f"Collectives at {collectives['per_gpu']}/GPU decode: "
                  f"{collectives['ms_per_step']:.3f} ms a step, "
                  f"{collectives['ms_per_layer']:.4f} ms a layer on {collectives['timeline']} "
                  f"(busy {collectives['device_busy_union_ms_per_step']:.3f} ms a step)."]
    elif args.profile_batch:
        lines += ["", "Collectives: the trace has no GPU timeline (a CPU run)."]
    return "\n".join(lines)
