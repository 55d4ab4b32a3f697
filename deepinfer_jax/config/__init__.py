"""Configuration resolved once: the model's (ModelConfig, its HF mapping) and the engine's options."""
