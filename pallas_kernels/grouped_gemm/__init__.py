"""Grouped GEMM for routed experts (and, with one group, the batch-invariant dense GEMM)."""
