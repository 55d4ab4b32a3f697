"""DeepSeek-V4's paged step in torch operations, one concern per file as deepinfer_jax/model/."""
