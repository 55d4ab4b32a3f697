"""The facts about the local devices that the engine's defaults depend on."""

from __future__ import annotations

import jax

from deepinfer_jax.config.options import DeviceFacts


def local_device_facts() -> DeviceFacts:
    """The default backend's first device: its platform and, on GPUs, compute capability."""
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return DeviceFacts(platform=device.platform,
                       compute_capability=None if capability is None else str(capability))
