"""The configuration's typed errors."""


class EngineConfigError(ValueError):
    """An engine option that cannot work with this model or with the other options."""
