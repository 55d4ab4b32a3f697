"""DeepSeek-V4.1 as pure functions beside V4's (model/): its parameter pytree, the Engram hash
and the QAT fake quantization; what it shares with V4 (mHC, MoE, rope, norms) is imported."""
