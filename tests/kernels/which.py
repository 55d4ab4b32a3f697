"""Which implementation the kernel tests run: compiled on a compute-capability 9.x GPU (the
Hopper kernels' target), interpreted on the CPU elsewhere."""

import jax

_device = jax.devices()[0]
ON_HOPPER = _device.platform == "gpu" and str(
    getattr(_device, "compute_capability", "0")).split(".")[0] == "9"
KERNEL = "mosaic_gpu" if ON_HOPPER else "interpret"
