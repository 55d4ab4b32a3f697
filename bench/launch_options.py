"""The decode step's launch under XLA's command-buffer options, by depth: one lowered step
compiled once per variant of compiler options, each timed the way the engine's loop calls it.

    python bench/launch_options.py                                     # CPU: small config
    python bench/launch_options.py --v4-flash-layers 2 4 --batch 1 --context 4096
    XLA_PYTHON_CLIENT_ALLOCATOR=vmm python bench/launch_options.py --v4-flash-layers 2 4

XLA runs a GPU step as CUDA graphs that hold every buffer address they touch; a call whose
arguments or temporaries sit elsewhere than the last call's updates the graphs' nodes first,
on the host. `xla_gpu_command_buffer_update_mode` SKIP_TEMP keeps the temporaries at stable
(VMM-remapped) addresses, SKIP_PROFILED also the arguments and outputs found stable over the
first calls; `xla_gpu_enable_pdl` lets a kernel start while its predecessor drains. The VMM
remapping needs the VMM allocator (`XLA_PYTHON_CLIENT_ALLOCATOR=vmm`, a process's setting:
one run per allocator).

Per depth: an engine reaches steady decode at `--batch` requests of `--context` tokens, then
its decode bucket's step is lowered once and compiled per variant. Per variant, from the same
state (copied back from the host): each call's output must equal the first variant's
(launch options change no arithmetic), then, `--repeats` times, `--steps` calls back to back
with a fresh plan buffer each (the engine's loop: the host launches while the device runs),
the same with one plan buffer reused, and the launch alone (each call waited for). Median and
min-max over the repeats; the slope is the last depth's pipelined ms less the first's, per
layer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.engine_loop import step_until_decoding  # noqa: E402
from bench.lib.models import SMALL_CPU, V4_FLASH, engine_params, slice_config  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402
from bench.lib.timing import MIN_REPEATS, Timing, spread  # noqa: E402
from deepinfer_jax import LLM, Model, SamplingParams  # noqa: E402
from deepinfer_jax.engine.compile import lower_step  # noqa: E402
from deepinfer_jax.host.buckets import token_bucket  # noqa: E402
from deepinfer_jax.host.plan_builder import build_plan  # noqa: E402
from deepinfer_jax.weights import random_params  # noqa: E402

UPDATE_MODE = "xla_gpu_command_buffer_update_mode"
VARIANTS = {                     # (the remapping modes last: the least tried)
    "default": {},
    "pdl": {"xla_gpu_enable_pdl": True},
    "skip-temp": {UPDATE_MODE: "SKIP_TEMP"},
    "skip-profiled": {UPDATE_MODE: "SKIP_PROFILED"},
}


def steady_engine(layers: int, args) -> LLM:
    """An engine of `layers` V4-Flash layers (or the small CPU config) decoding `args.batch`
    requests at `args.context` tokens."""
    cfg = slice_config(V4_FLASH if args.v4_flash_layers else SMALL_CPU, layers)
    params = engine_params(random_params(cfg, 0, jnp.bfloat16, release_formats=args.quantized))
    llm = LLM(Model(cfg, params), max_num_seqs=max(args.batch, 16),
              max_model_len=args.context + 512, max_num_batched_tokens=args.budget,
              token_buckets=tuple(sorted({16, args.budget})), enable_prefix_caching=False,
              compilation_cache_dir=str(REPO / ".cache" / "xla-bench"), show_progress=False)
    rng = np.random.default_rng(0)
    for i in range(args.batch):
        llm.engine.add_request(f"r{i}", rng.integers(2, cfg.vocab_size, args.context).tolist(),
                               SamplingParams(max_tokens=512, ignore_eos=True))
    step_until_decoding(llm.engine, args.batch)
    llm.engine.set_launch_thread(False)       # waits for the launched steps: state settled
    return llm


def pipelined_ms(exe, params, state, plan_host, steps: int, reuse: bool):
    """ms per call of `steps` calls back to back, each with its own plan buffer (or one)."""
    buffer = jax.device_put(plan_host)
    start = time.perf_counter()
    for _ in range(steps):
        state, out = exe(params, state, buffer if reuse else jax.device_put(plan_host))
    jax.block_until_ready(out)
    return 1e3 * (time.perf_counter() - start) / steps, state


def launch_ms(exe, params, state, plan_host, steps: int):
    """Median ms for the call to return (the host's launch), each call waited for."""
    samples = []
    for _ in range(steps):
        buffer = jax.device_put(plan_host)
        jax.block_until_ready(buffer)
        start = time.perf_counter()
        state, out = exe(params, state, buffer)
        samples.append(1e3 * (time.perf_counter() - start))
        jax.block_until_ready(out)
    return statistics.median(samples), state


def measure_depth(layers: int, args, variants: dict, record) -> None:
    """Each variant's row at this depth, handed to `record` as soon as it is measured (a
    variant that crashes the process leaves the rows before it written)."""
    t0 = time.perf_counter()
    llm = steady_engine(layers, args)
    engine = llm.engine
    decision = engine.scheduler.schedule()        # booked as launched; nothing reads it back
    bucket = token_bucket(engine.step_cfg.token_buckets, decision.num_tokens)
    plan = build_plan(decision, bucket, engine.step_cfg)
    compiled = engine.steps.select(bucket, decision.truncating_sampler)
    truncation = next(t for (b, t), step in engine.steps.by_key.items() if step is compiled)
    plan_host = compiled.plan_wire.pack_host(plan)
    lowered = lower_step(engine.params, engine.state, llm.model.config, engine.step_cfg, bucket,
                         truncation=truncation)
    state_host = jax.device_get(engine.state)
    device = jax.tree.leaves(engine.state)[0].sharding
    print(f"{layers} layers: steady decode at batch {args.batch} after "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    reference = None
    for name, options in variants.items():
        start = time.perf_counter()
        exe = lowered.compile(compiler_options=options)
        compile_s = time.perf_counter() - start
        state = jax.device_put(state_host, device)
        outputs = []
        for _ in range(3):                        # SKIP_PROFILED settles after 3 calls
            state, out = exe(engine.params, state, jax.device_put(plan_host))
            outputs.append(np.asarray(out))
        if reference is None:
            reference = outputs
        same = all(np.array_equal(a, b) for a, b in zip(outputs, reference))
        fresh, reused, launch = [], [], []
        for _ in range(args.repeats):
            ms, state = pipelined_ms(exe, engine.params, state, plan_host, args.steps, False)
            fresh.append(ms)
            ms, state = pipelined_ms(exe, engine.params, state, plan_host, args.steps, True)
            reused.append(ms)
            ms, state = launch_ms(exe, engine.params, state, plan_host, args.steps)
            launch.append(ms)
        row = {"layers": layers, "variant": name, "options": options,
               "outputs_equal_default": same, "compile_s": compile_s,
               "pipelined": Timing.of(fresh).row(), "pipelined_plan_reused": Timing.of(reused).row(),
               "launch": Timing.of(launch).row()}
        record(row)
        print(f"  {name:14} pipelined {row['pipelined']['ms']:.3f} ms "
              f"(plan reused {row['pipelined_plan_reused']['ms']:.3f}), launch "
              f"{row['launch']['ms']:.3f} ms, outputs equal: {same}", flush=True)
        del exe, state
    del llm, engine


def slopes(rows: list[dict], depths: list[int]) -> dict:
    """ms per added layer of the pipelined call, last depth against the first, per variant."""
    if len(depths) < 2:
        return {}
    first, last = depths[0], depths[-1]
    by = {(r["layers"], r["variant"]): r["pipelined"]["ms"] for r in rows}
    return {v: (by[last, v] - by[first, v]) / (last - first)
            for (layers, v) in by if layers == first and (last, v) in by}


def table(rows: list[dict], slope: dict, allocator: str) -> str:
    lines = [f"Allocator: `{allocator}`. ms per decode step: the median over the repeats, then "
             "their min-max (count).", "",
             "| layers | variant | pipelined, fresh plan | pipelined, plan reused | launch alone "
             "| outputs = default |",
             "|---:|---|---:|---:|---:|:---:|"]
    for r in rows:
        cells = [f"{r[k]['ms']:.3f}, {spread(r[k])}"
                 for k in ("pipelined", "pipelined_plan_reused", "launch")]
        lines.append(f"| {r['layers']} | {r['variant']} | {' | '.join(cells)} | "
                     f"{'yes' if r['outputs_equal_default'] else 'NO'} |")
    if slope:
        lines += ["", "Slope (pipelined ms per added layer): "
                  + ", ".join(f"{v} {s:.3f}" for v, s in slope.items())]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--v4-flash-layers", type=int, nargs="*", default=[],
                    help="depths of the V4-Flash slice (none: the small CPU config at 2 and 4)")
    ap.add_argument("--quantized", action="store_true")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--budget", type=int, default=256, help="max tokens per step")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=MIN_REPEATS)
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    depths = args.v4_flash_layers or [2, 4]
    allocator = os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default")
    label = ("V4-Flash dimensions" + (", release formats" if args.quantized else ", bf16")
             if args.v4_flash_layers else f"{SMALL_CPU.relative_to(REPO)}, sliced")
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    name = args.name or f"launch-options-{platform}" + ("" if allocator == "default" else
                                                         f"-{allocator}")
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append(row)
        slope = slopes(rows, depths)
        payload = {"model": label, "batch": args.batch, "context": args.context,
                   "allocator": allocator, "rows": rows, "slope_ms_per_layer": slope,
                   "environment": environment()}
        write_results(name, payload, table(rows, slope, allocator))

    for layers in depths:
        measure_depth(layers, args, {v: VARIANTS[v] for v in args.variants}, record)
    print(table(rows, slopes(rows, depths), allocator))
    if not all(r["outputs_equal_default"] for r in rows):
        raise SystemExit("a variant's outputs differ from the default compile's")

if __name__ == "__main__":
    main()
