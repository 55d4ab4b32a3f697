"""The Ascend (torch_npu) backend: the same `BatchPlan -> StepOutput` step contract as the JAX
engine, implemented with torch/torch_npu. The engine core never imports this package."""
