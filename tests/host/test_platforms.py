"""The platform feature table (config/platforms.py): every row's gate, and the README's copy."""

from __future__ import annotations

import pytest

from deepinfer_jax.config.errors import EngineConfigError
from deepinfer_jax.config.platforms import (
    FEATURES,
    PLATFORMS,
    UnsupportedFeatureError,
    markdown_table,
    require_features,
    supports,
)
from tests.conftest import REPO

# the table as the issue states it, written out independently of FEATURES
EXPECTED_UNSUPPORTED = {
    "ascend": {"batch_invariant", "quantized_weights", "deepseek_v41", "pallas_kernels",
               "draft_token_map"},
    "cpu": {"pallas_kernels"},
    "nvidia": set(),
}


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_every_row_gates_its_platforms(feature, platform):
    unsupported = feature in EXPECTED_UNSUPPORTED[platform]
    assert supports(platform, feature) is not unsupported
    if unsupported:
        with pytest.raises(UnsupportedFeatureError) as err:
            require_features(platform, ["continuous_batching", feature])
        assert (err.value.feature, err.value.platform) == (feature, platform)
        assert f"{feature} is not supported on {platform}" in str(err.value)
        assert isinstance(err.value, EngineConfigError)
    else:
        require_features(platform, [feature])


def test_batch_invariant_mode_is_refused_on_ascend_only():
    with pytest.raises(UnsupportedFeatureError, match="batch_invariant is not supported on ascend"):
        require_features("ascend", ["batch_invariant"])
    require_features("nvidia", ["batch_invariant"])
    require_features("cpu", ["batch_invariant"])


def test_unknown_names_are_typed_errors():
    with pytest.raises(EngineConfigError, match="unknown platform 'tpu'"):
        supports("tpu", "batch_invariant")
    with pytest.raises(EngineConfigError, match="unknown feature 'warp_drive'"):
        require_features("cpu", ["warp_drive"])


def test_readme_shows_the_table():
    assert markdown_table() in (REPO / "README.md").read_text()


def test_the_backend_is_resolved_once_from_the_argument_then_deepinfer_backend(monkeypatch):
    from deepinfer_jax.config.engine import EngineConfig
    monkeypatch.delenv("DEEPINFER_BACKEND", raising=False)
    assert EngineConfig().backend == "jax"
    monkeypatch.setenv("DEEPINFER_BACKEND", "ascend")
    options = EngineConfig()
    assert options.backend == "ascend"
    assert EngineConfig(backend="jax").backend == "jax"        # the argument wins
    monkeypatch.setenv("DEEPINFER_BACKEND", "jax")
    assert options.backend == "ascend"                         # frozen: read once
    with pytest.raises(EngineConfigError,
                       match=r"unknown backend 'npu'; expected one of \('jax', 'ascend'\)"):
        EngineConfig(backend="npu")
