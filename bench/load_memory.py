"""Host memory while loading a checkpoint in the release's formats, and what the device holds.

    python bench/load_memory.py --layers 3            # H200: ~12 GB of V4-Flash-sized shards
    python bench/load_memory.py --config configs/deepseek-v4-flash.json --layers 1 \
        --name load-memory-cpu                        # CPU: 5.3 GB, one V4-Flash layer
    python bench/load_memory.py --config configs/bench/small-cpu.json --layers 4   # CPU smoke

Writes a synthetic checkpoint (random FP8 dense projections with E8M0 block scales, FP4
routed experts with E8M0 group scales, bf16 rest; one shard per layer, the embedding and head
in their own) with its index, then loads it in a fresh process and records that process's
resident memory: its baseline (jax imported, the device initialised) and its peak (VmHWM)
after `load(..., weights="quantized")`, and, sampled every 5 ms during the load, the RSS
minus the bytes of the live jax arrays (the loader's own host memory: on a CPU backend the
"device" is host memory, so this is the figure that means anything there; on a GPU the
sampler takes the RSS alone). The loader reads tensors into buffers it owns, a piece at a
time for the large ones, so the peak should stay below the baseline plus 1.5x the largest
shard. Then it checks that the device holds the stored bytes, not bf16: every routed expert
is packed FP4 (uint8) and the parameters' bytes on the device equal the checkpoint's tensor
bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.lib.models import V4_FLASH, slice_config  # noqa: E402
from bench.lib.results import environment, write_results  # noqa: E402


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class _Sampler(threading.Thread):
    """Every `period` s: the resident set (/proc/self/statm) and, where the device is host
    memory (CPU), the bytes of the live jax arrays, whose difference is the loader's own host
    memory (read buffers, staging copies, allocator slack); on a GPU the arrays are not in the
    resident set and only the RSS is taken.

    A sample taken while the loading thread is inside jax (a CPU computation runs on the
    calling thread) is left out of the difference: the array that computation is making, or
    reusing in place from a donated one, is not in jax.live_arrays() until it returns, and its
    buffer would count as the loader's own. Such samples still count in the RSS peak."""

    def __init__(self, count_live: bool, period: float = 0.005):
        super().__init__(daemon=True)
        self.count_live, self.period = count_live, period
        self.samples: list[tuple[float, int, int, bool]] = []   # (s, rss, live bytes, in jax)
        self._done = threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._loader = threading.get_ident()

    def sample(self) -> tuple[int, int, bool]:
        import jax
        frame = sys._current_frames().get(self._loader) if self.count_live else None
        in_jax = frame is not None and any(part in frame.f_code.co_filename
                                           for part in ("/jax/", "/jaxlib/"))
        live = sum(a.nbytes for a in jax.live_arrays()) if self.count_live else 0
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * self._page
        return rss, live, in_jax

    def run(self) -> None:
        start = time.perf_counter()
        while not self._done.is_set():
            self.samples.append((time.perf_counter() - start, *self.sample()))
            self._done.wait(self.period)

    def stop(self) -> dict:
        self._done.set()
        self.join()
        over = [(rss - live, t) for t, rss, live, in_jax in self.samples if not in_jax]
        peak, at = max(over)
        bins: dict[int, tuple] = {}          # the timeline: the sample of most overhead per 0.25 s
        for t, rss, live, in_jax in self.samples:
            if not in_jax and rss - live >= bins.get(int(t * 4), (0, 0, 0, -1))[3]:
                bins[int(t * 4)] = (round(t, 3), rss, live, rss - live)
        return {"samples": len(self.samples), "samples_in_jax": len(self.samples) - len(over),
                "peak_overhead": peak, "peak_overhead_at_s": round(at, 3),
                "peak_overhead_with_jax_samples": max(rss - live for _, rss, live, _ in self.samples),
                "sampled_peak_rss": max(rss for _, rss, _, _ in self.samples),
                "timeline": [dict(zip(("s", "rss", "live", "overhead"), b))
                             for b in bins.values()]}


class _Recorder:
    """A builder source that records every tensor's name, shape and stored format."""

    dtype = np.float32

    def __init__(self):
        self.tensors: list[tuple[str, tuple[int, ...], str]] = []

    def has_prefix(self, prefix):
        return not prefix.startswith("mtp.")

    def place(self, tree):
        return tree

    def tensor(self, name, shape, role):
        from deepinfer_jax.weights.builder import Role
        kind = {Role.LINEAR: "bf16", Role.EMBED: "bf16", Role.TABLE: "i32"}.get(role, "f32")
        self.tensors.append((name, shape, kind))
        return np.zeros(shape, np.int8)

    def projection(self, name, shape, released_fp8):
        self.tensors.append((name, shape, "fp8" if released_fp8 else "bf16"))
        return np.zeros(shape[::-1], np.int8)

    def experts(self, names, shape):
        for column in names:
            for name in column:
                self.tensors.append((name, shape, "fp4"))
        return np.zeros((len(names[0]), shape[1], len(names) * shape[0]), np.int8)


def synthetic_tensors(name: str, shape: tuple[int, ...], kind: str, rng) -> dict[str, np.ndarray]:
    import ml_dtypes
    if kind == "fp8":
        out_dim, in_dim = shape
        codes = np.frombuffer(rng.bytes(out_dim * in_dim), np.uint8) & 0x77   # finite E4M3
        grid = (-(-out_dim // 128), -(-in_dim // 128))
        return {name: codes.reshape(shape).view(ml_dtypes.float8_e4m3fn),
                name[:-6] + "scale": np.full(grid, 120, np.uint8).view(ml_dtypes.float8_e8m0fnu)}
    if kind == "fp4":
        out_dim, in_dim = shape
        packed = np.frombuffer(rng.bytes(out_dim * in_dim // 2), np.int8).reshape(out_dim, -1)
        return {name: packed, name[:-6] + "scale": np.full((out_dim, in_dim // 32), 119, np.uint8)
                .view(ml_dtypes.float8_e8m0fnu)}
    if kind == "i32":
        return {name: np.zeros(shape, np.int32)}
    dtype = ml_dtypes.bfloat16 if kind == "bf16" else np.float32
    return {name: (rng.standard_normal(shape, np.float32) * 0.02).astype(dtype)}


def write_checkpoint(cfg, directory: Path) -> dict:
    """One shard per layer, one for everything else; returns the shard sizes."""
    from deepinfer_jax.config.hf import to_hf_dict
    from deepinfer_jax.config.model import QuantConfig
    from deepinfer_jax.weights.builder import build_params
    from deepinfer_jax.weights.safetensors_io import save_file

    recorder = _Recorder()
    build_params(cfg, recorder)
    shards: dict[str, list] = {}
    for name, shape, kind in recorder.tensors:
        shard = (f"layer-{int(name.split('.')[1]):03d}.safetensors" if name.startswith("layers.")
                 else "rest.safetensors")
        shards.setdefault(shard, []).append((name, shape, kind))
    rng = np.random.default_rng(0)
    weight_map, sizes = {}, {}
    for shard, entries in sorted(shards.items()):
        tensors = {}
        for name, shape, kind in entries:
            tensors |= synthetic_tensors(name, shape, kind, rng)
        save_file(tensors, directory / shard)
        weight_map |= {key: shard for key in tensors}
        sizes[shard] = (directory / shard).stat().st_size
        del tensors
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf = to_hf_dict(cfg.replace(quantization=QuantConfig()))
    (directory / "config.json").write_text(json.dumps({**hf, "dtype": "bfloat16"}))
    return sizes


def child(directory: Path) -> None:
    """Runs in its own process: the baseline, the load, the peak, what the device holds."""
    import jax
    import jax.numpy as jnp

    import deepinfer_jax
    from pallas_kernels.quantized import Fp4Blocks, is_quantized, nbytes

    jax.device_put(jnp.zeros(8)).block_until_ready()      # the runtime up
    platform = jax.devices()[0].platform
    sampler = _Sampler(count_live=platform == "cpu")
    baseline = _status("VmRSS")
    rss, live, _ = sampler.sample()
    baseline_overhead = rss - live
    sampler.start()
    tracemalloc.start()                 # numpy's buffers: the loader's own host memory
    model = deepinfer_jax.load(directory, weights="quantized")
    jax.block_until_ready(model.params)
    numpy_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    sampled = sampler.stop()
    leaves = jax.tree.leaves(model.params, is_leaf=is_quantized)
    experts = [layer.moe.experts.w13 for layer in model.params.layers]
    stats = jax.devices()[0].memory_stats() or {}
    print(json.dumps({
        "baseline_rss": baseline, "peak_rss": _status("VmHWM"), "numpy_peak": numpy_peak,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "param_bytes": sum(map(nbytes, leaves)),
        "experts_packed_fp4": all(isinstance(w, Fp4Blocks) and w.packed.dtype == jnp.uint8
                                  for w in experts),
        "device_bytes_in_use": stats.get("bytes_in_use"),
        "baseline_overhead": baseline_overhead, **sampled, "platform": platform}))


def _kept_checkpoint(cfg, directory: Path) -> dict:
    """The checkpoint in `directory`, written there first unless its index already is."""
    if not (directory / "model.safetensors.index.json").exists():
        directory.mkdir(parents=True, exist_ok=True)
        return write_checkpoint(cfg, directory)
    return {p.name: p.stat().st_size for p in sorted(directory.glob("*.safetensors"))}


def _measure(directory: Path) -> dict:
    """The load measured in a fresh process (child)."""
    done = subprocess.run([sys.executable, __file__, "--child", str(directory)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(done.stderr[-4000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=V4_FLASH)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint")
    ap.add_argument("--keep", type=Path, default=None,
                    help="write the checkpoint here and keep it; reused if already there")
    ap.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return
    cfg = slice_config(args.config, args.layers)
    if args.keep:
        sizes = _kept_checkpoint(cfg, args.keep)
        got = _measure(args.keep)
    else:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            sizes = write_checkpoint(cfg, Path(tmp))
            got = _measure(Path(tmp))
    largest, total = max(sizes.values()), sum(sizes.values())
    limit = got["baseline_rss"] + 1.5 * largest
    result = {"layers": args.layers, "shards": sizes, "largest_shard": largest,
              "checkpoint_bytes": total, **got, "limit_rss": limit,
              "within_limit": got["peak_rss"] <= limit,
              "peak_over_baseline_in_shards": (got["peak_rss"] - got["baseline_rss"]) / largest,
              "overhead_in_shards": (got["peak_overhead"] - got["baseline_overhead"]) / largest}
    gib, cpu = 2 ** 30, got["platform"] == "cpu"
    text = "\n".join([
        f"Synthetic V4 checkpoint ({args.config.name} cut to {args.layers} layers): "
        f"{len(sizes)} shards, {total / gib:.2f} GiB, largest {largest / gib:.2f} GiB.", "",
        "| measure | GiB |", "|---|---:|",
        f"| loader process baseline RSS (jax up) | {got['baseline_rss'] / gib:.2f} |",
        f"| peak RSS during the load (VmHWM) | {got['peak_rss'] / gib:.2f} |",
        f"| of which the loader's numpy buffers at their peak (tracemalloc) | "
        f"{got['numpy_peak'] / gib:.2f} |",
        f"| peak of RSS minus live device arrays, over its baseline "
        f"({'sampled every 5 ms' if cpu else 'on a GPU the RSS alone'}) | "
        f"{(got['peak_overhead'] - got['baseline_overhead']) / gib:.2f} |",
        f"| peak RSS sampled every 5 ms | {got['sampled_peak_rss'] / gib:.2f} |",
        f"| limit: baseline + 1.5 x largest shard | {limit / gib:.2f} |",
        f"| parameters' stored bytes on the device | {got['param_bytes'] / gib:.2f} |",
        f"| device bytes in use after the load | "
        f"{(got['device_bytes_in_use'] or 0) / gib:.2f} |", "",
        f"Peak minus baseline = {result['peak_over_baseline_in_shards']:.2f}x the largest shard "
        f"({'within' if result['within_limit'] else 'OVER'} the 1.5x limit"
        f"{'; on a CPU backend the RSS holds the parameters too' if cpu else ''}); the loader's "
        f"own host memory (peak of RSS{' minus live arrays' if cpu else ''}, over its baseline) "
        f"= {result['overhead_in_shards']:.2f}x the largest shard, at "
        f"{got['peak_overhead_at_s']:.2f} s of the load; routed experts kept packed FP4: "
        f"{got['experts_packed_fp4']}; platform {got['platform']}."])
    print(text)
    name = args.name or f"load-memory-{got['platform']}"
    write_results(name, {"environment": environment(), **result}, text)
    # FP8 scales are kept as float32 (4x their E8M0 bytes, ~1/4096 of a weight's), so the
    # stored bytes come within a few percent of the files'; bf16 experts would be ~3.5x.
    if not got["experts_packed_fp4"] or got["param_bytes"] > 1.05 * total:
        sys.exit(f"the device does not hold the packed formats: {got['param_bytes']} bytes "
                 f"of parameters from {total} bytes of checkpoint")


if __name__ == "__main__":
    main()
