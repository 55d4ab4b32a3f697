"""The facts about the local devices that the engine's defaults depend on."""

from __future__ import annotations

import jax

from deepinfer_jax.config.options import DeviceFacts


def local_device_facts() -> DeviceFacts:
    """This process's first device: its platform, on GPUs its compute capability, and
    the memory its allocator may use where it reports one (`bytes_limit`; the CPU does not);
    the devices and processes of every process joined (parallel/distributed.py)."""
    device = jax.local_devices()[0]
    capability = getattr(device, "compute_capability", None)
    return DeviceFacts(platform=device.platform,
                       compute_capability=None if capability is None else str(capability),
                       memory_bytes=_bytes_limit(device), device_count=jax.device_count(),
                       process_count=jax.process_count())


def _stats(device) -> dict:
    try:
        return device.memory_stats() or {}
    except Exception:       # backends without allocator statistics raise or return None
        return {}


def _bytes_limit(device) -> int | None:
    limit = _stats(device).get("bytes_limit")
    return int(limit) if limit else None


def held_outside_free_block(devices) -> int:
    """The most, over `devices`, of what the allocator holds outside its largest free block:
    live arrays and the holes between them (0 where it reports no such figures).

    A pool that grows on demand (XLA_PYTHON_CLIENT_PREALLOCATE=false) has reserved only
    `pool_bytes` of its limit; the rest is one block it can still take, so the largest free
    block is the larger of the two."""
    held = 0
    for device in devices:
        stats = _stats(device)
        if stats.get("bytes_limit") and "largest_free_block_bytes" in stats:
            limit = int(stats["bytes_limit"])
            free_block = int(stats["largest_free_block_bytes"])
            if "pool_bytes" in stats:
                free_block = max(free_block, limit - int(stats["pool_bytes"]))
            held = max(held, limit - free_block)
    return held
