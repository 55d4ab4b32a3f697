"""The two ceilings every GPU benchmark compares against, measured in its own run: XLA's
dense bf16 matmul rate and the device copy bandwidth (torch's copy where torch is there, as
the measured-facts reference; XLA's elementwise copy otherwise). A ceiling from another run
would compare a kernel with another GPU's clock and temperature."""

from __future__ import annotations

import statistics
import subprocess
import sys

import jax
import jax.numpy as jnp

from bench.lib.timing import timed_ms

# The H200's datasheet figures, the second yardstick beside each run's measured ceilings.
DATASHEET_TBPS = 4.8            # HBM3e bandwidth
DATASHEET_BF16_TFLOPS = 989     # dense bf16

def xla_matmul_tflops(n: int) -> float:
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    ms = timed_ms(jax.jit(jnp.dot), a, b)
    return 2 * n**3 / ms / 1e9


def beside_the_dot(fn, *args, n: int = 8192, rounds: int = 5) -> dict:
    """fn(*args) and the ceiling's n^3 dot timed alternately, `rounds` times each (medians):
    the two rates in the same thermal state. A long run heats the GPU and its clock falls
    (the H200 here: the dot 738 TFLOP/s at a run's start, 654 after a minute of GEMMs), so
    a kernel timed minutes after the run's ceiling is compared with a faster GPU than its own."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    dot = jax.jit(jnp.dot)
    fn_ms, dot_ms = [], []
    for _ in range(rounds):
        dot_ms.append(timed_ms(dot, a, a))
        fn_ms.append(timed_ms(fn, *args))
    return {"ms": statistics.median(fn_ms), "dot_ms": statistics.median(dot_ms),
            "dot_tflops": 2 * n**3 / statistics.median(dot_ms) / 1e9}


def beside_the_dot_table(results: list[dict]) -> list[str]:
    """Markdown lines for the rows timed by beside_the_dot (their "beside_dot" entry, with the
    rate it gives them), or none."""
    beside = [r for r in results if "beside_dot" in r]
    if not beside:
        return []
    lines = ["", "Timed alternately with the ceiling's 8192^3 dot (5 rounds each, medians, both "
             "timed on the host: the two rates in one thermal state; the ceiling above was "
             "measured at the run's start, on a cooler, faster-clocked GPU):", "",
             "| case | impl | ms | TFLOP/s | dot TFLOP/s beside it | % of the dot |",
             "|---|---|---:|---:|---:|---:|"]
    for r in beside:
        b = r["beside_dot"]
        case = f"{r['case']} {r.get('op', '')}".strip()
        lines.append(f"| {case} | {r['impl']} | {b['ms']:.3f} | "
                     f"{b['tflops']:.1f} | {b['dot_tflops']:.1f} | "
                     f"{100 * b['tflops'] / b['dot_tflops']:.0f}% |")
    return lines


def xla_copy_tbps(num_bytes: int) -> float:
    x = jax.random.normal(jax.random.key(0), (num_bytes // 2,), jnp.bfloat16)
    ms = timed_ms(jax.jit(lambda v: v * 1), x)   # one read and one write of each byte
    return 2 * num_bytes / ms / 1e9


TORCH_COPY = """
import torch, statistics
x = torch.randn(2**30, device="cuda", dtype=torch.bfloat16); y = torch.empty_like(x)
for _ in range(3): y.copy_(x)
t = []
for _ in range(20):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); y.copy_(x); b.record(); torch.cuda.synchronize(); t.append(a.elapsed_time(b))
print(2 * x.numel() * 2 / statistics.median(t) / 1e9)
"""


def torch_copy_tbps() -> float | None:
    """torch's device copy, in its own process (two allocators would fight over memory)."""
    try:
        out = subprocess.run([sys.executable, "-c", TORCH_COPY], capture_output=True, text=True,
                             timeout=120, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    except Exception:   # noqa: BLE001 - no torch or no CUDA: report XLA's copy only
        return None


def measure(small: bool = False) -> dict:
    """The ceilings (small: tiny sizes, for CPU smoke runs; no torch)."""
    ceilings = {"matmul_tflops": xla_matmul_tflops(256 if small else 8192),
                "xla_copy_tbps": xla_copy_tbps(2**20 if small else 2**32)}
    torch_tbps = None if small else torch_copy_tbps()
    ceilings["torch_copy_tbps"] = torch_tbps
    ceilings["copy_tbps"] = torch_tbps or ceilings["xla_copy_tbps"]
    ceilings["copy_source"] = "torch copy_" if torch_tbps else "XLA elementwise"
    return ceilings
