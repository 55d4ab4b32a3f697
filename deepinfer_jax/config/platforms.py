"""Which engine features each platform supports: one table for both backends.

The JAX engine runs on NVIDIA GPUs and on the CPU; the Ascend backend (ascend_backend/, torch
and torch_npu) on Ascend NPUs, tested on torch's CPU device. An engine asks `require_features`
at start-up with the features its options turn on, and an unsupported combination fails there
with an UnsupportedFeatureError naming the feature and the platform, instead of running
without it. README.md shows the same table (tests/host/test_platforms.py keeps them equal).
"""

from __future__ import annotations

from collections.abc import Iterable

from deepinfer_jax.config.errors import EngineConfigError

PLATFORMS = ("nvidia", "ascend", "cpu")

# backend -> the platforms it runs on. One LLM (api/llm.py) drives either engine with the
# same host loop and scheduler; api/backends.py starts the one EngineConfig.backend names.
# The Ascend backend checks its features against "ascend" even on torch's CPU device (where
# CI runs it): what it supports is a property of its step, not of the chip under it.
BACKENDS: dict[str, tuple[str, ...]] = {
    "jax": ("nvidia", "cpu"),
    "ascend": ("ascend",),
}

# feature -> the platforms that support it. Batch invariance is NVIDIA's and the CPU's (the
# jnp formulations of model/invariant.py); the Ascend step has no invariant formulation (as
# in the reference engine, where it is NVIDIA-only). The Ascend backend runs the DeepSeek-V4
# model with the shared scheduler (docs/ascend.md): the features marked no are not ported yet.
FEATURES: dict[str, tuple[str, ...]] = {
    "continuous_batching": ("nvidia", "ascend", "cpu"),
    "chunked_prefill": ("nvidia", "ascend", "cpu"),
    "batch_invariant": ("nvidia", "cpu"),
    "speculative_decoding": ("nvidia", "ascend", "cpu"),
    # the MTP block drafting from a token map (speculative_config.draft_token_map)
    "draft_token_map": ("nvidia", "cpu"),
    "prefix_caching": ("nvidia", "ascend", "cpu"),
    "structured_output": ("nvidia", "ascend", "cpu"),
    # FP8 / FP4 weights kept quantized on the device (the Ascend backend reads a quantized
    # release, dequantized to float32 at load)
    "quantized_weights": ("nvidia", "cpu"),
    "deepseek_v41": ("nvidia", "cpu"),
    "pallas_kernels": ("nvidia",),
}


class UnsupportedFeatureError(EngineConfigError):
    """A feature asked for that the platform does not support (raised at start-up)."""

    def __init__(self, feature: str, platform: str):
        self.feature, self.platform = feature, platform
        supported = ", ".join(FEATURES[feature])
        super().__init__(f"{feature} is not supported on {platform} (supported on: {supported})")


def check_backend(backend: str) -> str:
    """A known backend's name (EngineConfigError naming the known ones otherwise)."""
    if backend not in BACKENDS:
        raise EngineConfigError(f"unknown backend {backend!r}; expected one of {tuple(BACKENDS)}")
    return backend


def supports(platform: str, feature: str) -> bool:
    if platform not in PLATFORMS:
        raise EngineConfigError(f"unknown platform {platform!r}; expected one of {PLATFORMS}")
    if feature not in FEATURES:
        raise EngineConfigError(f"unknown feature {feature!r}; expected one of {sorted(FEATURES)}")
    return platform in FEATURES[feature]


def require_features(platform: str, features: Iterable[str]) -> None:
    """Raise UnsupportedFeatureError for the first feature the platform does not support."""
    for feature in features:
        if not supports(platform, feature):
            raise UnsupportedFeatureError(feature, platform)


def markdown_table() -> str:
    """The table as README.md shows it."""
    lines = ["| feature | " + " | ".join(PLATFORMS) + " |",
             "|---|" + "---|" * len(PLATFORMS)]
    for feature, platforms in FEATURES.items():
        marks = ["yes" if p in platforms else "no" for p in PLATFORMS]
        lines.append(f"| {feature} | " + " | ".join(marks) + " |")
    return "\n".join(lines)
