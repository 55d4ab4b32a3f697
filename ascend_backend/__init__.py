"""The Ascend (torch_npu) backend: the same `BatchPlan -> StepOutput` step contract as the JAX
engine, implemented with torch/torch_npu, driven by the JAX engine's host side (scheduler,
plan builder, prefix cache, grammar masks). The engine core never imports this package, and
this package never imports jax (docs/ascend.md).

Entry points: `deepinfer_jax.LLM(checkpoint, backend="ascend")` (or DEEPINFER_BACKEND=ascend),
which starts the engine through `ascend_backend.engine_start.start`;
`ascend_backend.engine.AscendEngine`, and the steps `ascend_backend.step.step` and
`ascend_backend.speculative.spec_step`.
"""
