"""The configuration's typed errors."""


class EngineConfigError(ValueError):
    """An engine option that cannot work with this model or with the other options."""


class InsufficientMemoryError(EngineConfigError):
    """The model, its activations and a usable cache do not fit in the device memory the
    engine may use: raised at start-up, before the step is compiled (config/memory.py)."""
