"""Which implementation runs: the per-op override, the all-ops override, the validated default."""

import pytest

from pallas_kernels.common import implementation, on_hopper_or_newer


def test_one_ops_override_wins_over_every_ops(monkeypatch):
    monkeypatch.setenv("DEEPINFER_KERNELS", "reference")
    monkeypatch.setenv("DEEPINFER_KERNEL_SINKHORN", "interpret")
    assert implementation(False, "sinkhorn") == "interpret"
    assert implementation(True, "sink_attention") == "reference"


def test_without_overrides_a_validated_kernel_runs_on_hopper_only(monkeypatch):
    monkeypatch.delenv("DEEPINFER_KERNELS", raising=False)
    monkeypatch.delenv("DEEPINFER_KERNEL_GROUPED_GEMM", raising=False)
    want = "mosaic_gpu" if on_hopper_or_newer() else "reference"
    assert implementation(True, "grouped_gemm") == want
    assert implementation(False, "grouped_gemm") == "reference"   # unvalidated: asked for only


def test_an_unknown_choice_names_its_variable(monkeypatch):
    monkeypatch.setenv("DEEPINFER_KERNEL_SINKHORN", "triton")
    with pytest.raises(ValueError, match="DEEPINFER_KERNEL_SINKHORN"):
        implementation(True, "sinkhorn")
