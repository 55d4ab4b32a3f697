"""Where V4.1's fake quantization parts a GPU from the CPU: each of its pieces run on both
backends of one process over the same inputs, compared bit for bit (issue 35's GPU test run:
the V4.1 forward matched the reference to 1e-5 with the fake quantization off and by O(1)
with it on, on an H100). The cast pairs are expected to differ there (XLA drops them), the
float32 roundings that replace them not.

    python bench/fake_quant_probe.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deepinfer_jax.model.precision import rounded_to
from deepinfer_jax.model.v41 import fake_quant


def _pieces():
    return {
        "f32 -> e4m3fn -> f32": lambda x: x.astype(jnp.float8_e4m3fn).astype(jnp.float32),
        "clip(x / 2^-3) -> e4m3fn": lambda x: jnp.clip(x / 0.125, -448.0, 448.0)
        .astype(jnp.float8_e4m3fn).astype(jnp.float32),
        "f32 -> bf16 -> f32": lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
        "rounded_to bf16": lambda x: rounded_to(x, jnp.bfloat16),
        "round_e4m3": lambda x: fake_quant.round_e4m3(jnp.clip(x, -448.0, 448.0)),
        "pow2_ceil": lambda x: fake_quant.pow2_ceil(jnp.abs(x) + 1e-3),
        "nextafter": lambda x: jnp.nextafter(x, jnp.inf),
        "round_e2m1": lambda x: fake_quant.round_e2m1(jnp.clip(x, -6.0, 6.0)),
        "fake_quant_fp8": lambda x: fake_quant.fake_quant_fp8(x, 32),
        "fake_quant_fp4 ue8m0": lambda x: fake_quant.fake_quant_fp4(x, 32),
        "fake_quant_fp4 e4m3": lambda x: fake_quant.fake_quant_fp4(x, 16, e4m3_scales=True),
    }


def main() -> None:
    gpu, cpu = jax.devices()[0], jax.devices("cpu")[0]
    print("devices:", gpu, cpu)
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(1 << 16) * s for s in (0.01, 1.0, 30.0)])
    x = x.astype(np.float32).reshape(-1, 64)
    for name, fn in _pieces().items():
        f = jax.jit(fn)
        on_gpu = np.asarray(f(jax.device_put(x, gpu)))
        on_cpu = np.asarray(f(jax.device_put(x, cpu)))
        differ = on_gpu.view(np.uint32) != on_cpu.view(np.uint32)
        line = f"{name:28s} differing {int(differ.sum()):7d} of {differ.size}"
        if differ.any():
            i = np.flatnonzero(differ)[:4]
            flat_x = np.broadcast_to(x, on_gpu.shape).ravel() if on_gpu.shape == x.shape else None
            line += f"  e.g. gpu {on_gpu.ravel()[i]} cpu {on_cpu.ravel()[i]}"
            if flat_x is not None:
                line += f" x {flat_x[i]}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
